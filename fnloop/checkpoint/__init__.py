"""Checkpoints: the state, serialized to one safetensors file; atomic, safe, inspectable.

A checkpoint is a safetensors file. Its tensors are stored under their path in
the state (``state.params['fc.weight']``); everything else is a JSON skeleton
in the file's metadata, next to the format version and a CRC-32 covering the
skeleton and every tensor's bytes. Loading runs no code (there is no pickle),
fills a template built from code (``like=``) strictly, and keeps hook states
the template does not know as ``fnloop.Unclaimed`` for the run to claim.
See ``docs/checkpoints.md``.

This module moves the bytes and checks the checksum; the file's header is
``fnloop.checkpoint._safetensors``, the skeleton ``fnloop.checkpoint._codec``, the state's policy
``fnloop.checkpoint._state_codec`` and the atomic write ``fnloop._atomic``.
"""

from fnloop.checkpoint._codec import CheckpointError, CheckpointMismatch, DamagedCheckpoint, Record
from fnloop.checkpoint._files import CheckpointWarning, checkpoints, latest, load, path_for, read_raw, save
from fnloop.checkpoint._resume import RunChanged, resume
from fnloop.checkpoint._safetensors import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointWarning",
    "DamagedCheckpoint",
    "Record",
    "RunChanged",
    "checkpoints",
    "latest",
    "load",
    "path_for",
    "read_raw",
    "resume",
    "save",
]
