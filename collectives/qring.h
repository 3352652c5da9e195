// qring's public C++ interface in one header, installed as <qring/qring.h> (cmake/package.cmake;
// find_package(qring) or pkg-config qring). A process goes from its launcher's environment to
// a communicator in one call (Session), then runs collectives and the quorum all-reduce:
//
//   #include <qring/qring.h>
//   qring::collectives::Session s;   // qring-launch, torchrun, mpirun, Slurm or QRING_*
//   qring::collectives::QuorumOptions qo;
//   qo.quorum = s.size() - 1;
//   qring::collectives::QuorumAllreduce q(s.comm(), n, qo);
//   q.contribute(step, grad, n);
//   auto result = q.wait(step, grad);   // grad = mean over result.count contributors
//
// Contracts: docs/design.md (quorum all-reduce, membership); errors: net/base/error.h.
#pragma once

#include "collectives/communicator.h"
#include "collectives/quorum/quorum.h"
#include "collectives/session.h"
#include "collectives/straggler.h"
#include "collectives/types.h"
#include "net/base/error.h"
#include "net/rendezvous/bootstrap.h"
