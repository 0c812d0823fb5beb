// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
/* membership.c — the node's one owner of job membership: the maps job_of_cgroup, job_of_tgid, job_kinds and their
 * upkeep at fork, exit and exec (the handlers of common.h), loaded once per node. Every probe's module finds these
 * maps pinned (common.h, JOB_PIN_DIR) and only reads them; user space (jobprobe/kernel/membership.py) writes the jobs in.
 * Hooks: sched:sched_process_fork, sched:sched_process_exit, sched:sched_process_exec. Oldest kernel: 4.18.
 * Cost: per fork, exit or exec on the node, one hash lookup and at most one update or delete (common.h).
 */
#define JOB_MEMBERSHIP
#include "common.h"
