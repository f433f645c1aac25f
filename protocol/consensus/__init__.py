"""One single-decision BFT consensus instance (SPEC.md section 6).

Tendermint-style rounds with a collector: the round's leader broadcasts a Proposal,
every validator sends its Prevote to that leader only, the leader broadcasts the
quorum it gathered as a PrevoteCertificate, validators lock and send a Precommit to
the leader, and the leader broadcasts the quorum of precommits as a
CommitCertificate. That is five one-to-all or all-to-one steps, O(n) messages per
decision instead of Tendermint's O(n^2) all-to-all voting (SPEC.md 6.4). In an
epoch of at most 4 members votes go to every member and each forms the certificates
itself (SPEC.md 6.11): two sequential hops fewer, for a few more messages.

The rules that keep this honest (each cited where it is enforced):
- a node signs at most one Proposal, Prevote and Precommit per round, and every vote
  or lock appears in ``Ready.persist`` before the message that depends on it
  (SPEC.md 6.9), so a restarted node restored from its records never double-votes;
- a locked node prevotes only its locked value, or a value carrying a prevote
  certificate from a round at or after its lock (SPEC.md 6.6);
- every input returns one ``Ready``; bad remote input is counted in ``dropped`` and
  never raises; calling ``propose`` when not ``awaiting_value`` raises
  LocalProtocolError; the instance never reads a clock.

``Decision.value`` is the raw value bytes; MeshCore decodes them with
``protocol.messages.decode_value``. Events: "awaiting_value", "proposed",
"proposal_rejected", "prevote_quorum", "locked", "decided", "round_change",
"evidence", "gave_up".

Where each part lives:
- ``instance``: ``ConsensusInstance``, the state machine (inputs, rounds, proposals,
  votes, certificates, round changes);
- ``safety``: ``LockProof`` and ``SafetyLog``, its own signatures and lock, their persist
  records and their restore (6.9);
- ``collector``: ``Collector``, the votes a round's leader gathers into certificates (6.4);
- ``rounds``: ``OtherRounds``, round changes and round syncs, proposals of later rounds,
  replies to members in other rounds (6.5, 6.8);
- ``checks``: judging a proposal, and the locks other members report (6.5, 6.6);
- ``evidence``: ``Equivocations``, conflicting messages turned into evidence (6.10).
"""

from protocol.consensus.checks import RoundProposal, Validate, judge_proposal, proof_of_lock_error, reported_lock
from protocol.consensus.collector import Collector
from protocol.consensus.evidence import MAX_EVIDENCE, Equivocations
from protocol.consensus.instance import ConsensusInstance
from protocol.consensus.rounds import (MAX_CATCH_UP_REPLIES, MAX_FUTURE_PROPOSALS, MAX_ROUNDS_AHEAD,
                                       MAX_SYNC_ITEM_BYTES, MAX_SYNC_REPLIES, OtherRounds)
from protocol.consensus.safety import LockProof, Restored, SafetyLog

__all__ = ["MAX_CATCH_UP_REPLIES", "MAX_EVIDENCE", "MAX_FUTURE_PROPOSALS", "MAX_ROUNDS_AHEAD", "MAX_SYNC_ITEM_BYTES",
           "MAX_SYNC_REPLIES", "Collector", "ConsensusInstance", "Equivocations", "LockProof", "OtherRounds",
           "Restored", "RoundProposal", "SafetyLog", "Validate", "judge_proposal", "proof_of_lock_error",
           "reported_lock"]
