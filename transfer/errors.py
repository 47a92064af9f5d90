"""Typed errors of the transfer package.

Every error names what was expected and what was found. Agent implementations translate their
backend's exceptions (NIXL's twelve unrelated exception classes, ZMQ errors, OS errors) into these,
so callers never import a backend to catch a failure.
"""
from __future__ import annotations

# Why a submitted transfer ended in ERR (`XferHandle.cause`): what callers decide on (the handle's
# `error` text is for people and logs only). One enum for every layer: PEER_LOST (the remote agent
# or its process is gone: invalidate it), FAILED (anything else: backend error, invalidated remote,
# shutdown).
from protocol.failures import Cause as FailureCause


class TransferError(Exception):
    """Base class of every error raised by `transfer/`."""


class AgentUnavailable(TransferError):
    """The requested agent kind cannot be created on this machine (package missing, backend failed)."""


class AgentMismatch(TransferError):
    """Two ends use different agent kinds or wire versions; detected when metadata is loaded."""


class NameConflict(TransferError):
    """A remote agent name is already loaded with a different incarnation (invalidate it first)."""


class RemoteNotLoaded(TransferError):
    """A transfer names a remote agent whose metadata was never loaded (or was invalidated)."""


class OutOfRange(TransferError):
    """A descriptor is not covered by the registered memory of its side."""


class PeerLost(TransferError):
    """The remote agent (or its process) went away while a transfer or control exchange needed it."""

    cause = FailureCause.PEER_LOST


class InvalidDescriptors(TransferError, ValueError):
    """Descriptor arrays have the wrong shape, dtype or inconsistent lengths."""


class ConfigMismatch(TransferError):
    """The two ends of a transfer disagree on a parameter that must match (agent kind, block size,
    layout version, dtype, model geometry). Raised at the RankInfo exchange, never at a write."""


class UnsupportedTopology(TransferError):
    """The two page tables cannot be mapped onto each other (groupings, CP, mapper kinds)."""


class ProtocolError(TransferError):
    """A control-plane message is malformed or arrives in a state that does not allow it."""


class SessionError(TransferError):
    """A session operation is invalid (duplicate, retired, unknown request)."""
