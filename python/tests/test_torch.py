"""The quorum all-reduce and qring.torch over real ranks under qring-launch: the mean over
contributors against torch's, a straggler's gradient dropped, bit-identical parameters,
SIGKILL of a rank, restart and rejoin, mismatched models, the examples."""
import os
import re

import pytest
from conftest import LAUNCH, PYTHON, ROOT, launch, run


def test_mean_over_contributors_matches_torch_and_a_straggler_is_dropped():
    # Rank 2 is 800 ms late every step, quorum 3 of 4: it is never counted, every rank gets
    # the mean of ranks 0, 1 and 3's gradients, as torch computes it from those gradients.
    # (At load ~30 on 2 cores a rank's step can be 300 ms late on its own: then rank 2 would
    # be counted in its place.)
    job = launch(4, ["mean", "--steps", "4", "--quorum", "3", "--straggler", "fixed:2:800"])
    assert job.rc == 0, job
    assert len(job.results) == 16, job
    by_step = {}
    for r in job.results:
        assert r["contributors"] == [0, 1, 3] and r["count"] == 3, job
        assert r["max_err"] <= 1e-6 * r["scale"] + 1e-8, job
        by_step.setdefault(r["step"], set()).add(r["digest"])
    excluded = [r["excluded"] for r in job.results]
    assert excluded.count(True) == 4, job  # rank 2, every step
    # Bit-identical results on every rank, counted or not.
    assert all(len(d) == 1 for d in by_step.values()), job


@pytest.mark.parametrize("wait", ["block", "poll"])
def test_mean_over_all_ranks_without_stragglers(wait):
    # qring.init(wait=...): blocking on the shm doorbells or polling, the same results.
    job = launch(3, ["mean", "--steps", "3", "--wait", wait])
    assert job.rc == 0, job
    assert len(job.results) == 9, job
    for r in job.results:
        assert r["contributors"] == [0, 1, 2] and not r["excluded"], job
        assert r["max_err"] <= 1e-6 * r["scale"] + 1e-8, job


def test_parameters_stay_bit_identical_with_stragglers():
    # Different initial parameters per rank (broadcast_parameters makes them equal), a
    # straggler model that changes who is counted, and the digest checked every step.
    job = launch(4, ["train", "--steps", "30", "--quorum", "3", "--straggler", "lognormal:2.5:1.0",
                     "--seed-by-rank"])
    assert job.rc == 0, job
    ranks = job.by_rank()
    assert sorted(ranks) == [0, 1, 2, 3], job
    assert len({res[-1]["checksum"] for res in ranks.values()}) == 1, job
    contributors = ranks[0][-1]["contributors"]
    assert len(contributors) == 30 and all(len(c) >= 3 for c in contributors), job
    assert any(len(c) == 3 for c in contributors), job  # someone was dropped sometimes


def test_sigkill_of_a_rank_the_others_finish():
    job = launch(4, ["train", "--quorum", "3", "--evict-ms", "1500", "--kill-rank", "2",
                     "--kill-step", "5", "--pace-ms", "10", "--until", "left"],
                 launcher_args=["--tolerate-failures", "1"])
    assert job.rc == 101, job  # one rank lost, the others exited 0
    ranks = job.by_rank()
    assert sorted(ranks) == [0, 1, 3], job
    assert len({res[-1]["checksum"] for res in ranks.values()}) == 1, job
    for res in ranks.values():
        assert res[-1]["members"] == [0, 1, 3], job
    assert len({res[-1]["steps"] for res in ranks.values()}) == 1, job
    assert "rank 2" in job.out and "SIGKILL" in job.out, job


def test_a_stopped_rank_is_evicted_and_the_others_go_on():
    # Rank 2 stopped (SIGSTOP) for 4 s, evict time 1 s: the others evict it and go on (400
    # steps more, 10 ms apart: at least 4 s after the view change, so they outlast the stop);
    # rank 2, continued, learns it was evicted (qring.Evicted: exit status 75, a lost rank for
    # qring-launch). With 200 steps a fast machine finished the job before rank 2 continued,
    # and nobody was left to tell it.
    job = launch(4, ["train", "--quorum", "3", "--evict-ms", "1000", "--stop-rank", "2",
                     "--stop-step", "5", "--stop-ms", "4000", "--pace-ms", "10", "--until", "left",
                     "--extra", "400"],
                 launcher_args=["--tolerate-failures", "1"], timeout=180)
    assert job.rc == 101, job
    ranks = job.by_rank()
    survivors = {r: res[-1] for r, res in ranks.items() if r != 2}
    assert sorted(survivors) == [0, 1, 3], job
    assert len({f["checksum"] for f in survivors.values()}) == 1, job
    assert all(f["members"] == [0, 1, 3] for f in survivors.values()), job
    assert ranks[2][-1].get("error") == "Evicted", job
    assert "evicted (exit status 75)" in job.out, job


def test_a_lost_quorum_is_an_exception_naming_the_rank():
    # Quorum = world and rank 1 killed: the others cannot go on. Each gets a qring exception
    # naming rank 1 within the evict time (the launcher tolerates the losses so that it does
    # not stop them first), never a hang or a crash.
    job = launch(3, ["train", "--steps", "100", "--evict-ms", "1000", "--kill-rank", "1",
                     "--kill-step", "3", "--pace-ms", "10"],
                 launcher_args=["--tolerate-failures", "2"], timeout=120)
    assert job.rc != 0, job
    errors = {r["rank"]: r for r in job.results if "error" in r}
    assert sorted(errors) == [0, 2], job
    for e in errors.values():
        assert e["error"] in ("QuorumLost", "QuorumTimeout"), job
        assert "rank 1" in e["message"] or "ranks 1" in e["message"], job


def test_restarted_rank_rejoins_with_the_same_parameters():
    job = launch(4, ["train", "--quorum", "3", "--evict-ms", "1500", "--kill-rank", "2",
                     "--kill-step", "5", "--pace-ms", "10", "--until", "rejoined",
                     "--extra", "10", "--seed-by-rank"],
                 launcher_args=["--max-restarts", "1"], timeout=240)
    assert job.rc == 0, job
    ranks = job.by_rank()
    assert sorted(ranks) == [0, 1, 2, 3], job
    rejoined = [r for r in ranks[2] if "rejoined" in r]
    assert rejoined and rejoined[0]["incarnation"] == 1 and rejoined[0]["rejoined"] > 5, job
    final = {r: res[-1] for r, res in ranks.items()}
    assert len({f["checksum"] for f in final.values()}) == 1, job
    assert all(f["members"] == [0, 1, 2, 3] for f in final.values()), job
    assert final[2]["incarnation"] == 1, job
    assert len({f["steps"] for f in final.values()}) == 1, job


def test_mismatched_models_are_rejected_naming_the_ranks():
    job = launch(3, ["train", "--steps", "2", "--hidden", "1:17"])
    assert job.rc != 0, job
    errors = [r for r in job.results if "error" in r]
    assert errors, job
    for e in errors:
        assert e["error"] == "ConfigError", job
        assert "parameter count" in e["message"] and "on rank(s) 1" in e["message"], job
        assert "on rank(s) 0, 2" in e["message"], job


def test_example_cnn_runs_under_qring_launch():
    job = run([LAUNCH, "-n", "2", "--", PYTHON,
               os.path.join(ROOT, "python", "examples", "fmnist_cnn.py"), "--steps", "12",
               "--quorum", "1", "--straggler", "fixed:1:50", "--test-samples", "1000"],
              timeout=240)
    assert job.rc == 0, job
    assert '"test_accuracy"' in job.out, job
    sums = re.findall(r'params_checksum"?:? "?([0-9a-f]{8})', job.out)
    assert len(sums) == 2 and len(set(sums)) == 1, job
