"""The one exception hierarchy of meshnode (STYLE.md: h11's Local/Remote split).

``MeshError`` is the root every project error derives from, so a caller can catch
the project's failures without catching programming bugs. A ``RemoteProtocolError``
means a peer (or a file from outside) sent something invalid: drop it, count it,
keep going. A ``LocalProtocolError`` means this process asked for something illegal.
Errors about files (keystores, configs) derive from ``MeshError`` in keys/errors.py.
"""


class MeshError(Exception):
    """Root of every error meshnode raises on purpose."""


class RemoteProtocolError(MeshError):
    """Bad remote input: malformed, oversized, forged, replayed or stale."""


class LocalProtocolError(MeshError):
    """This node asked the protocol core for something the rules forbid."""


class ManifestError(MeshError):
    """A job manifest is invalid; the message names the field and what was expected."""


class SubmitOverloaded(LocalProtocolError):
    """SPEC 10.5: the entry node already has its bound of submitted jobs undecided; the text
    ends with "retry in N ms" (``retry_after_ms``), which clients parse."""

    def __init__(self, undecided: int, bound: int, retry_after_ms: int):
        super().__init__("overloaded: %d jobs submitted to this node are undecided (node.max_undecided_submits = %d): "
                         "retry in %d ms" % (undecided, bound, retry_after_ms))
        self.retry_after_ms = retry_after_ms
