"""How every rank of a group learns that some rank refused a collective call, so that the call ends on every
rank instead of leaving the others waiting for the refusing one: ``CallRefusedError``, and ``Refusals``, the
part of ``runtime.CommObject`` (EPAllToAll, AsyncTP) that checks a call and passes a refusal on.

What reaches the peers depends on the call:
  - a constructor: one exchange of every rank's settings and verdict (``_configure_on_every_rank``);
  - a call made of host collectives: every rank's verdict on it, exchanged before them (``_agree``);
  - a call made of kernels that wait on each other, which no collective agrees on: the refusing rank writes
    which call and why into its row of every peer's refusal board, a small symmetric buffer
    (``_tell_refusal``), and a peer whose wait for it times out reads the board (``_raise_refused``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives


class CallRefusedError(ValueError):
    """A collective call (a constructor, a reference dispatch or combine) that one or more ranks refused,
    raised on every rank of the group with the same message, so that no rank is left waiting for the
    refusing one; or a kernel's call that peers refused, raised where a wait for them timed out
    (``Refusals._raise_refused``). `refusals` maps each refusing rank to its reason (the ValueError it
    raised)."""

    def __init__(self, what: str, refusals: dict[int, str]):
        self.what, self.refusals = what, refusals
        ranks_of: dict[str, list[int]] = {}
        for rank, reason in sorted(refusals.items()):
            ranks_of.setdefault(reason, []).append(rank)
        parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {reason}"
                 for reason, ranks in ranks_of.items()]
        super().__init__(f"{what} refused by " + "; ".join(parts))


def _reason_bytes(refusal: ValueError | None, size: int) -> torch.Tensor:
    """uint8 [size]: the message of `refusal` (its type's name where empty) in UTF-8, cut to `size` bytes
    ("..." ending what was cut) and padded with zeros; all zeros for None."""
    out = torch.zeros(size, dtype=torch.uint8)
    if refusal is not None:
        reason = (str(refusal) or type(refusal).__name__).encode()
        reason = reason if len(reason) <= size else reason[:size - 3] + b"..."
        out[:len(reason)] = torch.frombuffer(bytearray(reason), dtype=torch.uint8)
    return out


def _reason_text(row: torch.Tensor) -> str:
    """The message ``_reason_bytes`` wrote into the uint8 `row`."""
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")


class Refusals:
    """The checks of a CommObject's calls, and the exchanges by which every rank learns of a refusal (the
    module's docstring says which call takes which). A call is checked by ``_check_call`` before anything
    runs. A subclass whose calls are kernels waiting on each other opens a refusal board
    (``_open_refusals``); a peer whose wait for a refusing rank then times out raises CallRefusedError
    naming it instead of the bare CommTimeoutError.

    Part of ``runtime.CommObject``, whose attributes it reads (`rank`, `world`, `group`, `device`, `timeout_s`,
    `_symmetric`, `_broken`) and whose methods it calls: ``_raise_if_failed`` (what an earlier call left),
    ``_place`` (a constructor's device check) and ``_break`` (the object broken by a timeout).
    """

    VERDICT_BYTES = 256      # a refusal's reason as every rank reads it (the checks' messages fit; longer is cut)
    CALLS: tuple[str, ...] = ()   # the calls a subclass counts (``_calls``), which a refusal note names
    NOTE_HEADER = 16         # bytes of a note before its reason: int64 CALLS index + 1 (0: no note), int64 call
    REFUSALS = "refusals"    # the board's name among the symmetric buffers

    def _agree(self, what: str, refusal: ValueError | None) -> None:
        """Every rank's verdict on a collective call, before the call's own collectives: one all_gather of
        VERDICT_BYTES per rank, bounded by ``timeout_s``. A rank that refused (`refusal`, its ValueError)
        still takes part with its reason, so that every rank raises the same CallRefusedError naming it,
        and no rank enters the call's collectives alone. A rank that does not take part within timeout_s
        (it made another call, or none) breaks the object: CommTimeoutError here and at every later call."""
        verdict = _reason_bytes(refusal, self.VERDICT_BYTES)
        verdicts = torch.empty(dist.get_world_size(self.group) * self.VERDICT_BYTES, dtype=torch.uint8)
        try:
            collectives.all_gather_into_tensor(verdicts, verdict, group=self.group, timeout_s=self.timeout_s)
        except RuntimeError as error:
            raise self._break(f"rank {self.rank}: {what} was not agreed by every rank within {self.timeout_s}s (a "
                              f"rank of the group made another call, or none): {error}") from error
        refusals = {rank: _reason_text(row)
                    for rank, row in enumerate(verdicts.view(-1, self.VERDICT_BYTES)) if row[0]}
        if refusals:
            raise CallRefusedError(what, refusals) from refusal

    def _check_call(self, what: str, check, *args, agreed: bool = False):
        """This rank's checks of its next call of `what` (a name of CALLS), before anything runs: what an
        earlier call left (``_raise_if_failed``), then check(*args), which raises ValueError for a bad argument
        (and returns what this returns: what the checks worked out, or None).
        Where a collective agrees on every call (`agreed`: the calls are host collectives), every rank's verdict
        on it follows (``_agree``: CallRefusedError on every rank if any rank refused). Otherwise a refusal
        is told to the peers (``_tell_refusal``, a no-op without a board) and raised, unless it only reports
        peers' refusals (CallRefusedError)."""
        try:
            self._raise_if_failed()
            if not agreed:
                return check(*args)
            refusal = checked = None
            try:
                checked = check(*args)
            except ValueError as error:
                refusal = error
            self._agree(what, refusal)
            return checked
        except ValueError as refusal:
            if not agreed and not isinstance(refusal, CallRefusedError):
                self._tell_refusal(what, self._calls()[what] + 1, refusal)
            raise

    def _configure_on_every_rank(self, what: str, configure, settings: dict, group, backend: str, device) -> None:
        """A constructor's checks, agreed by every rank: configure() (which raises ValueError for a bad
        argument) and ``_place``'s device check on this rank, then ``_agree_on_settings`` over `group`."""
        refusal = None
        try:
            configure()
            self._place(group, backend, device)
        except ValueError as error:
            refusal = error
        self._agree_on_settings(what, settings, refusal, group)

    @staticmethod
    def _agree_on_settings(what: str, settings: dict, refusal: ValueError | None, group=None) -> None:
        """A constructor's one exchange (collective, once): every rank's `settings` (the arguments every
        rank must pass alike) and its `refusal` (the ValueError its checks raised, or None). Raises on
        every rank: CallRefusedError if a rank refused, else ValueError naming each setting the ranks
        differ on, with each value's ranks."""
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (None if refusal is None else str(refusal), settings), group=group)
        refusals = {rank: reason for rank, (reason, _) in enumerate(every) if reason is not None}
        if refusals:
            raise CallRefusedError(what, refusals) from refusal
        differences = []
        for name in settings:
            ranks_of: dict[str, list[int]] = {}
            for rank, (_, theirs) in enumerate(every):
                ranks_of.setdefault(repr(theirs.get(name)), []).append(rank)
            if len(ranks_of) > 1:
                values = ", ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                                   for value, r in ranks_of.items())
                differences.append(f"{name} ({values})")
        if differences:
            raise ValueError(f"{what}: the ranks of the group were built with different settings, which must be the "
                             f"same on every rank: {'; '.join(differences)}")

    # ------------------------------------------------------------------------------------ the refusal board

    def _open_refusals(self, symmetric_zeros, put) -> None:
        """The refusal board, from symmetric_zeros(shape, dtype) (collective: allocated with the object's other
        symmetric buffers, in the same order on every rank): uint8 [W, NOTE_HEADER + VERDICT_BYTES], row r
        the note of the last call rank r refused. `put(dst, src, pe)` copies the contiguous `src` into `pe`'s
        copy of `dst`, a view of a symmetric tensor (``put_on_stream``: over whatever transport reaches pe)."""
        self._symmetric[self.REFUSALS] = symmetric_zeros((self.world, self.NOTE_HEADER + self.VERDICT_BYTES),
                                                         torch.uint8)
        self._put = put

    def _calls(self) -> dict[str, int]:
        """How many calls of each name of CALLS this rank has made (a note names call n of one of them)."""
        return {}

    def _tell_refusal(self, what: str, call: int, refusal: ValueError) -> None:
        """This rank refused call number `call` of `what` (a name of CALLS) with `refusal`: its note (which
        call, and why, cut to VERDICT_BYTES) is put into this rank's row of every peer's board, with no
        collective, from a stream of its own (this rank's queued kernels may be waiting on peers), which this
        waits for. Nothing without a board, or while a CUDA graph is being captured (no peer runs then)."""
        board = self._symmetric.get(self.REFUSALS)
        cuda = self.device.type == "cuda"
        if board is None or (cuda and torch.cuda.is_current_stream_capturing()):
            return
        header = torch.tensor([self.CALLS.index(what) + 1, call], dtype=torch.int64).view(torch.uint8)
        note = torch.cat([header, _reason_bytes(refusal, self.VERDICT_BYTES)])
        stream = torch.cuda.Stream(self.device) if cuda else None
        with torch.cuda.stream(stream):
            note = note.to(self.device)
            for pe in range(self.world):
                if pe != self.rank:
                    self._put(board[self.rank], note, pe)
        if stream is not None:
            stream.synchronize()

    def _raise_refused(self, timeout: RuntimeError) -> None:
        """A wait of this rank timed out (`timeout`, the CommTimeoutError not raised yet). If peers left notes
        of calls this rank has made (the one that failed, or an earlier one not yet reported), consume them and
        raise CallRefusedError naming those ranks and their reasons, from `timeout`; the object stays broken,
        as after any timeout (its peers' counters are a call apart). Returns where there is no board or no
        such note. Waits for the device first: the failed kernels have finished."""
        board = self._symmetric.get(self.REFUSALS)
        if board is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        calls, notes = self._calls(), {}
        for rank, row in enumerate(board.cpu()):
            kind, call = row[:self.NOTE_HEADER].view(torch.int64).tolist()
            if 0 < kind <= len(self.CALLS) and call <= calls[self.CALLS[kind - 1]]:
                notes[rank] = (self.CALLS[kind - 1], call, _reason_text(row[self.NOTE_HEADER:]))
                board[rank].zero_()
        if not notes:
            return
        refused = CallRefusedError(", ".join(sorted({f"{what} call {call}" for what, call, _ in notes.values()})),
                                   {rank: reason for rank, (_, _, reason) in notes.items()})
        self._broken = f"{refused} ({self._broken})"
        raise refused from timeout
