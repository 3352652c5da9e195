#!/usr/bin/env python3
"""Reads the runs of scripts/fault_case42.sh (issue 42's cases) from their logs and outputs.

  fault_case42.py run OUT CASE PROVIDER I NAME EPOCHS EVICT_MS   one run's line
  fault_case42.py table OUT CASE PROVIDER RUNS EPOCHS EVICT_MS [PHASE]
                                                                  every run again, one table

Each run is read from OUT/NAME.log (qring-launch's output, every line of rank R prefixed
"[rank R] "), NAME.exit (the launcher's status; case 9: NAME.exit1 for the first run),
NAME.end (when the launcher ended), NAME.kill (when the fault from outside came), NAME.pauses
and NAME/run/{summary.json,metrics.jsonl}. The table is made from the files, not from what
the run printed, so it can be printed again (--analyze-only).
"""
import json
import os
import re
import sys
from datetime import datetime

STAMP = re.compile(r"^\[rank (\d+)\] \[(\d\d:\d\d:\d\d\.\d\d\d)\]")


def t(s):
    return datetime.strptime(s.strip(), "%H:%M:%S.%f")


def read(path, default=None):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def first_after(lines, since, pred):
    """Seconds from `since` to the first stamped line at or after it that matches."""
    for line in lines:
        m = STAMP.match(line)
        if m and since and t(m.group(2)) >= since and pred(line):
            return (t(m.group(2)) - since).total_seconds()
    return None


def counts_check(lines, base):
    """Case 10: steps missing and twice in metrics.jsonl; summary failures, rejoins against the
    departures and admissions the logs show."""
    steps = []
    for line in (read(os.path.join(base, "run", "metrics.jsonl"), "") or "").splitlines():
        j = json.loads(line)
        if j["type"] == "step":
            steps.append(j["step"])
    s = json.loads(read(os.path.join(base, "run", "summary.json"), "null") or "null")
    if not steps or not s:
        return None
    left = {}
    for line in lines:
        m = re.search(r"quorum: view (\d+): members \[[0-9, ]*\]; left: (.*)$", line)
        if m:
            left[m.group(1)] = len(re.findall(r"rank \d+ \(", m.group(2)))
    # Admissions, as the members logged them (each view that took a rank back, once).
    joins = len(set(re.findall(r"view (\d+): rank (\d+) rejoined at step", "\n".join(lines))))
    missing = len(set(range(max(steps) + 1)) - set(steps))
    twice = len(steps) - len(set(steps))
    ok = (missing == 0 and twice == 0 and s["failures_survived"] == sum(left.values())
          and s["rejoins"] == joins)
    return ok, (f"steps missing {missing}, twice {twice}; failures, rejoins "
                f"{s['failures_survived']}, {s['rejoins']} (logs {sum(left.values())}, {joins})")


def analyze(out, case, provider, i, name, evict_ms, clean_acc):
    base = os.path.join(out, name)
    text = read(base + ".log", "") or ""
    if case == "9":  # the run that is judged is the resumed one
        first, _, text = text.partition("=== --resume ===")
    lines = text.splitlines()
    r = {"case": case, "provider": provider, "run": i, "name": name}
    r["exit"] = int((read(base + ".exit", "-1") or "-1").strip() or -1)
    summary = json.loads(read(os.path.join(base, "run", "summary.json"), "null") or "null")
    r["finished"] = bool(summary and summary.get("finished"))
    sums = re.findall(r"params_checksum ([0-9a-f]{16})", text)
    r["checksums"], r["distinct"] = len(sums), len(set(sums))
    r["accuracy"] = summary.get("test_accuracy") if summary else None
    r["delta"] = (100 * (r["accuracy"] - clean_acc)
                  if r["accuracy"] is not None and clean_acc is not None else None)
    r["recovery"] = summary.get("recovery_s") if summary else None
    r["exited"] = r["exit"] not in (124, 137, -1)
    kill = read(base + ".kill")
    dead = t(kill) if kill else None
    end = read(base + ".end")
    check, ok = "", r["finished"] and r["distinct"] == 1
    if case == "1":
        p = (read(base + ".pauses", "") or "").split()
        start = read(base + ".from", "0.7").strip()
        check = f"{len(p)} pauses from step {start} S, longest {max(map(float, p)) if p else 0:.0f} ms"
        ok = ok and r["exit"] == 0 and len(p) > 0
    elif case == "3":
        # Lost once the last of the three died: from that death to the error that stops the
        # job; the launcher ends when the incarnations it had restarted before are done too.
        kills = [t(STAMP.match(l).group(2)) for l in lines if STAMP.match(l) and "injecting fault" in l]
        stop = next((t(STAMP.match(l).group(2)) for l in lines
                     if STAMP.match(l) and "the job stops:" in l), None)
        r["recovery"] = (stop - max(kills)).total_seconds() if kills and stop else None
        ended = (t(end) - max(kills)).total_seconds() if kills and end else None
        why = next((l for l in lines if "the job stops:" in l), "")
        why = why.split("the job stops: ", 1)[-1]
        lost_at = next((k for k, l in enumerate(lines) if "the job is lost" in l), None)
        late = sum("restarting it (restart" in l for l in lines[lost_at:]) if lost_at else 0
        restarts = sum("restarting it (restart" in l for l in lines)
        r["finished"] = False  # one rank of four left: the job must stop
        r["launcher_after"] = ended
        ok = (r["exit"] == 74 and r["recovery"] is not None and r["recovery"] <= evict_ms / 1000 + 1
              and bool(why) and late == 0)
        f = lambda x: "-" if x is None else f"{x:.2f}"
        check = (f"job stopped {f(r['recovery'])} s after the last kill, launcher ended "
                 f"{f(ended)} s after it; restarts {restarts}, after the loss was known {late}; "
                 + (f"error: \"{why[:170]}\"" if why else "no error naming the rule"))
    elif case in ("4", "5"):
        if case == "4":
            for line in lines:
                m = STAMP.match(line)
                if m and "injecting fault kill:0:60:donate" in line:
                    dead = t(m.group(2))
        no0 = first_after(lines, dead, lambda l: re.search(r"quorum: view \d+: members .*left: .*rank 0 \(", l))
        back_rank = "1" if case == "4" else "0"
        back = first_after(lines, dead, lambda l: f"rank {back_rank} rejoined at step" in l
                           and l.startswith(f"[rank {back_rank}]"))
        r["recovery"] = no0
        # Reached only if the second fault came: rank 0 died (case 4: as it was about to send
        # the state; case 5: after rank 1 rejoined, which must happen before the end).
        r["reached"] = dead is not None
        f = lambda x: "-" if x is None else f"{x:.2f}"
        c = counts_check(lines, base)
        r["counts_ok"] = bool(c and c[0])
        check = (f"rank 0 dead -> view without it {f(no0)} s, rank {back_rank} back {f(back)} s; "
                 f"{c[1] if c else 'no metrics or summary'}"
                 + ("" if r["reached"] else "; NOT REACHED: rank 0 was never killed"))
        ok = ok and r["reached"]
    elif case == "7":
        # The survivors' last logged line (their outputs' end) to the launcher's end.
        ends = [t(STAMP.match(l).group(2)) for l in lines if STAMP.match(l)]
        after = (t(end) - max(ends)).total_seconds() if ends and end else None
        r["launcher_after"] = after
        left = read(base + ".left")
        check = (f"launcher ended {after:.2f} s after the last survivor's end" if after is not None
                 else "no survivor ended") + ("; the stopped rank was left running" if left else "")
        ok = ok and r["exit"] == 101 and not left
    elif case == "9":
        e1 = (read(base + ".exit1", "-1") or "-1").strip()
        m = re.search(r"resumed from step (\d+)", text)
        fresh = "starting fresh" in text
        r["resumed"] = int(m.group(1)) if m else None
        took = re.search(r"rank 2 has no checkpoint of step \d+[^;]*; it takes the state from rank \d+", text)
        check = (f"first run (rank 2 killed, SIGTERM) exit {e1}; resumed from step "
                 f"{r['resumed'] if m else '-'}{', started fresh' if fresh else ''}"
                 f"{'; ' + took.group(0) if took else ''}")
        ok = ok and r["exit"] == 0 and bool(m) and r["resumed"] > 0 and not fresh
    elif case == "11":
        p = (read(base + ".pauses", "") or "").split()
        views = sum('"type":"view"' in l for l in
                    (read(os.path.join(base, "run", "metrics.jsonl"), "") or "").splitlines())
        r["views"] = views
        check = f"pauses {', '.join(p) or '-'} ms; view changes {views}"
        ok = ok and r["exit"] == 0 and views == 0 and len(p) == 2
    elif case in ("2", "8"):
        want = 102 if case == "2" else 101  # two ranks lost, one rank lost
        check = f"launcher exit {r['exit']} (want {want})"
        ok = ok and r["exit"] == want
    r["check"], r["ok"] = check, bool(ok)
    return r


def line(r):
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
    return (f"  {r['name']}: exit {r['exit']}, {'finished' if r['finished'] else 'LOST'}, "
            f"{r['checksums']} checksums ({r['distinct']} distinct), recovery {f(r['recovery'])} s, "
            f"accuracy {f(r['accuracy'], 4)} ({f(r['delta'])} points), "
            f"{'ok' if r['ok'] else 'NOT OK'}: {r['check']}")


def clean_accuracies(out, provider, epochs):
    """The test accuracies of the fault-free runs clean-PROVIDER-eEPOCHS-I, I = 1, 2, ..."""
    accs, i = [], 1
    while True:
        name = f"clean-{provider}-e{epochs}-{i}"
        if not os.path.exists(os.path.join(out, name + ".log")):
            return accs
        s = read(os.path.join(out, name, "run", "summary.json"))
        if s and json.loads(s).get("finished"):
            accs.append(json.loads(s)["test_accuracy"])
        i += 1


def clean_accuracy(out, provider, epochs):
    """What a case's accuracy is compared with: the mean of the fault-free runs."""
    accs = clean_accuracies(out, provider, epochs)
    return sum(accs) / len(accs) if accs else None


# Student's t, two-sided 95 %, by degrees of freedom (1-30; above, 2.0).
T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
       2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04]


def mean_difference(a, b):
    """Mean of a minus mean of b (points) with its 95 % interval (Welch); None: too few runs."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = (va + vb) ** 0.5
    df = (va + vb) ** 2 / max(1e-300, va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t95 = T95[min(max(int(df), 1), len(T95)) - 1] if df < 31 else 2.0
    return 100 * (ma - mb), 100 * t95 * se


def accuracy_cell(deltas, accs, clean):
    """A case's accuracy against the clean runs: its runs' deltas to the clean mean, and the
    difference of the means with its 95 % interval, judged against the issue's 0.5 points."""
    if not deltas:
        return "-"
    cell = f"{min(deltas):+.2f} to {max(deltas):+.2f}"
    d = mean_difference(accs, clean)
    if d:
        lo, hi = d[0] - d[1], d[0] + d[1]
        verdict = ("within 0.5" if lo >= -0.5 and hi <= 0.5 else
                   "more than 0.5 lower" if hi < -0.5 else "more than 0.5 higher" if lo > 0.5 else
                   "not decided")
        cell += f"; mean {d[0]:+.2f} [{lo:+.2f}, {hi:+.2f}]: {verdict}"
    return cell


def epochs_of(case, epochs):
    return max(epochs, 3) if case in ("4", "5") else epochs


def table(out, case, provider, runs, epochs, evict_ms, phase):
    cases = ["1", "2", "3", "4", "5", "7", "8", "9", "11"] if case == "all" else [case]
    print(f"\nissue 42's cases, {provider}, W=4 quorum 2 evict_ms {evict_ms}, MLP "
          f"{epochs} epochs (cases 4, 5: {max(epochs, 3)}); shared 2-core machine, no RDMA "
          f"hardware (shm and tcp are real libfabric providers)")
    print("| case | runs | lost jobs | checksums | recovery max (s) | accuracy delta (points) | "
          "launcher exited | case's check |")
    print("|---|---|---|---|---|---|---|---|")
    for e in sorted({epochs_of(c, epochs) for c in cases}):
        clean = clean_accuracies(out, provider, e)
        if clean:
            m = sum(clean) / len(clean)
            print(f"| fault-free, {e} epoch{'s' if e > 1 else ''} | {len(clean)} | - | - | - | "
                  f"accuracy {100 * m:.2f} %, runs {100 * (min(clean) - m):+.2f} to "
                  f"{100 * (max(clean) - m):+.2f} from their mean | - | the reference |")
    rows = {}
    for c in cases:
        e = epochs_of(c, epochs)
        acc = clean_accuracy(out, provider, e)
        tag = f"-{phase}" if phase and c == "8" else ""
        rs = [analyze(out, c, provider, i, f"case{c}{tag}-{provider}-{i}", evict_ms, acc)
              for i in range(1, runs + 1)
              if os.path.exists(os.path.join(out, f"case{c}{tag}-{provider}-{i}.log"))]
        rows[c] = rs
        if not rs:
            continue
        n = len(rs)
        lost = sum(not r["finished"] for r in rs)
        d = sorted({r["distinct"] for r in rs})
        rec = [r["recovery"] for r in rs if r["recovery"] is not None]
        deltas = [r["delta"] for r in rs if r["delta"] is not None]
        oks = sum(r["ok"] for r in rs)
        unreached = sum(r.get("reached") is False for r in rs)
        lost_s = f"{lost} (must stop)" if c == "3" else str(lost)
        extra = {"1": "exit 0 with a lagging rank at the end",
                 "3": "exit 74 within evict + 1 s naming the rule, no restart after",
                 "7": "exit 101, stopped rank ended by the launcher",
                 "9": "resumed from the survivors' newest checkpoint",
                 "11": "no view change"}.get(c, "one checksum, finished")
        if c == "7":
            la = [r["launcher_after"] for r in rs if r.get("launcher_after") is not None]
            if la:
                extra += f" {min(la):.1f}-{max(la):.1f} s after the others"
        if c == "3":
            la = [r["launcher_after"] for r in rs if r.get("launcher_after") is not None]
            if la:
                extra += f" (launcher ended {min(la):.1f}-{max(la):.1f} s after the last kill)"
        if c == "9":
            res = sorted({r["resumed"] for r in rs if r.get("resumed")})
            if res:
                extra += f" (step {', '.join(map(str, res))})"
        rec_s = f"{max(rec):.2f}" if rec else "-"
        delta_s = ("-" if c == "3" else  # the job must stop: no accuracy
                   accuracy_cell(deltas, [r["accuracy"] for r in rs if r["accuracy"] is not None],
                                 clean_accuracies(out, provider, e)))
        if unreached:
            extra += f" ({unreached} of {n} runs never reached the second fault)"
        print(f"| {c}{tag} | {n} | {lost_s} | {'-'.join(map(str, d))} | {rec_s} | {delta_s} | "
              f"{sum(r['exited'] for r in rs)}/{n} | {extra}: {oks}/{n} |")
    c45 = [r for c in ("4", "5") for r in rows.get(c, [])]
    if c45:
        ok = sum(r.get("counts_ok", False) for r in c45)
        print(f"| 10 | {len(c45)} (of 4, 5) | - | - | - | - | - | metrics.jsonl each step once, "
              f"summary counts = logs: {ok}/{len(c45)} |")


def main():
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "run":
        case, provider, i, name, epochs, evict = sys.argv[3:9]
        acc = clean_accuracy(out, provider, epochs_of(case, int(epochs)))
        if case == "clean":
            s = read(os.path.join(out, name, "run", "summary.json"))
            print(f"  {name}: exit {(read(os.path.join(out, name + '.exit'), '-') or '-').strip()}, "
                  f"accuracy {json.loads(s)['test_accuracy'] if s else '-'}")
            return
        print(line(analyze(out, case, provider, int(i), name, float(evict), acc)), flush=True)
    else:
        case, provider, runs, epochs, evict = sys.argv[3:8]
        phase = sys.argv[8] if len(sys.argv) > 8 else ""
        if case != "clean":
            table(out, case, provider, int(runs), int(epochs), float(evict), phase)


if __name__ == "__main__":
    main()
