"""The quota bound of SPEC.md Q2d as a safety check of the simulator (SPEC.md Q2f).

Every job that needs a grant runs only with one (Q2c, checked by every honest validator),
and an honest home or deputy grants only within the quota by its own count, which holds
every job it granted until its table shows the job ended (Q2b). So, per honest signer H
and (owner, pool): **the demands of the jobs running on honest nodes that H granted sum
to at most the quota**, but for a job H's table shows cancelled whose primary runs it
past H's cancel grace (Q2e: H counts it from its first tick after the cancel for
``CANCEL_STOP_GRACE_ROUNDS`` maximal round timeouts; a primary that has not heard the
cancel by then still runs it). What remains of Q2d follows: with k honest signers
among an owner's running jobs, their jobs hold at most k x L (homes that did not hear
each other, a home change), and jobs only a Byzantine member granted are not bounded.

A job counts once however many honest nodes run it (a move's old and new primary for the
moment of the hand-over hold one job of the owner, F5); runs on Byzantine nodes are on
their own capacity (Q2 (c)). The check reads what honest nodes run (their drivers' runs)
and who signed each grant (the cores' ``quota_granted`` events), never a member's table.
"""

from __future__ import annotations

from typing import Callable

from keys.identity import short_id
from protocol.quota import Usage, demand

DIMENSIONS = ("gpu_milli", "cpu_milli", "mem_mib")


class QuotaBoundCheck:
    """``limit_of(owner, pool) -> Usage | None``: the owner's quota in the pool (None: none);
    ``grace_ms``: Q2e's cancel grace; ``fail(check, node, instance, detail)``: records a
    violation (DecisionChecker.fail); ``key_of(index)``: a node's public key, for details."""

    def __init__(self, limit_of: Callable, grace_ms: int, fail: Callable, key_of: Callable = lambda index: b""):
        self.limit_of = limit_of
        self.grace_ms = grace_ms
        self.fail = fail
        self.key_of = key_of
        self.signers: dict[bytes, dict[int, int]] = {}       # job id -> signer index -> when it first granted
        self.cancel_applied: dict[int, dict[bytes, int]] = {}  # node -> job id -> when its table showed it cancelled
        self.cancel_counted_from: dict[int, dict[bytes, int]] = {}   # node -> job id -> its first tick since then
        self.reported: set[tuple] = set()                    # (signer, owner, pool, job ids) already failed
        self.peak_signer_over_gpu_milli = 0   # the most one honest signer's running jobs exceeded the quota
        self.peak_honest_over_gpu_milli = 0   # the most all honest signers' running jobs exceeded it, together
        self.peak_honest_signers = 0          # k: the most honest signers among one owner's running jobs

    # --- what the cores did ------------------------------------------------------------------------
    def granted(self, signer: int, jid: bytes, now_ms: int) -> None:
        self.signers.setdefault(jid, {}).setdefault(signer, now_ms)

    def cancelled(self, node: int, jid: bytes, now_ms: int) -> None:
        """The node's table shows the job cancelled (the first time: a restarted core that
        applies it again from disk was quiet meanwhile, Q2b, so the first grace is the one)."""
        self.cancel_applied.setdefault(node, {}).setdefault(jid, now_ms)

    def ticked(self, node: int, now_ms: int) -> None:
        """Node ``node`` ticked: a home notes a cancel at its first tick after applying it (Q2e)."""
        applied = self.cancel_applied.get(node)
        if not applied:
            return
        counted = self.cancel_counted_from.setdefault(node, {})
        for jid, at_ms in applied.items():
            if jid not in counted and at_ms <= now_ms:
                counted[jid] = now_ms

    def excused(self, signer: int, jid: bytes, now_ms: int) -> bool:
        """Q2e: the signer counted the cancelled job for its grace and then stopped counting it."""
        since = self.cancel_counted_from.get(signer, {}).get(jid)
        return since is not None and now_ms >= since + self.grace_ms

    # --- the bound -----------------------------------------------------------------------------------
    def check(self, now_ms: int, running: dict, honest: frozenset) -> None:
        """``running``: job id -> JobManifest of every job an honest node that is up runs now."""
        by_signer: dict[tuple, list] = {}    # (signer, owner, pool) -> job ids it granted that run
        honest_jobs: dict[tuple, set] = {}   # (owner, pool) -> job ids some honest signer granted
        honest_signers: dict[tuple, set] = {}
        for jid, job in running.items():
            key = (job.owner, job.scheduling.pool)
            for signer in self.signers.get(jid, ()):
                if signer not in honest:
                    continue
                honest_jobs.setdefault(key, set()).add(jid)
                honest_signers.setdefault(key, set()).add(signer)
                if not self.excused(signer, jid, now_ms):
                    by_signer.setdefault((signer, *key), []).append(jid)
        for (signer, owner, pool), jids in by_signer.items():
            limit = self.limit_of(owner, pool)
            if limit is None:
                continue
            used = self._usage(jids, running)
            self.peak_signer_over_gpu_milli = max(self.peak_signer_over_gpu_milli, used.gpu_milli - limit.gpu_milli)
            over = [(name, getattr(used, name), getattr(limit, name)) for name in DIMENSIONS
                    if getattr(used, name) > getattr(limit, name)]
            report = (signer, owner, pool, frozenset(jids))
            if over and report not in self.reported:
                self.reported.add(report)
                self.fail("quota", signer, None, "at %d ms honest node %d (%s) granted jobs of owner %s in pool %r "
                          "that run together over its quota: %s; jobs %s" % (
                              now_ms, signer, short_id(self.key_of(signer)), short_id(owner), pool,
                              ", ".join("%s %d > %d" % item for item in over),
                              ", ".join(self._describe(jid, running, now_ms) for jid in sorted(jids))))
        for key, jids in honest_jobs.items():
            limit = self.limit_of(*key)
            if limit is not None:
                self.peak_honest_over_gpu_milli = max(self.peak_honest_over_gpu_milli,
                                                      self._usage(jids, running).gpu_milli - limit.gpu_milli)
                self.peak_honest_signers = max(self.peak_honest_signers, len(honest_signers[key]))

    @staticmethod
    def _usage(jids, running: dict) -> Usage:
        total = Usage()
        for jid in jids:
            total = total + demand(running[jid].resources)
        return total

    def _describe(self, jid: bytes, running: dict, now_ms: int) -> str:
        granted = ", ".join("node %d at %d ms" % item for item in sorted(self.signers.get(jid, {}).items()))
        return "%s (%d GPU milli, granted by %s)" % (jid.hex()[:12], demand(running[jid].resources).gpu_milli,
                                                    granted)
