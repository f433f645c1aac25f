"""Value flows: one object per kind of decided value (SPEC.md 7).

A consensus instance decides one value; what that value is, how a leader builds it, how
a validator checks it and what applying it changes is the business of its flow:

- placement.py: one job's placement (P2-P6), by its own instance;
- slot.py: the first placements of every job created in one slot window (P7);
- epoch_change.py: how an epoch ends, an eviction with its migrations or a join (F4-F7);
- move.py: a healthy running job moved to another node at its owner's request (R2).
- preemption.py: stopping lower-priority jobs on one node to place a held job (P8).
- gang.py: every rank of a gang placed by one decision, a gang's attempt ending whole (GA1-GA5).
- gang_replace.py: a gang's rank whose node was evicted replaced (GA7).
- gang_resize.py: an elastic gang shrunk or grown back, one numbered resize at a time (GA8, GA9).

base.py defines the interface every flow implements and ``FlowRegistry``, the one place
a value-kind string is mapped to its flow. A new kind of value (a gang placement, a
preemption, a reflex action) is one new file here plus one line in the registry.
"""
