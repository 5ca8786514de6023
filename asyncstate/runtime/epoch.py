"""EpochManager: non-record events (watermarks) take effect after every earlier record.

Records join the open epoch when they become in flight. A non-record event closes the open
epoch with a trigger action and a final action and opens the next one. Epochs finish
strictly in order: when a closed epoch at the head of the queue has no records left, its
trigger action runs (work it starts, such as timer firings, joins this finishing epoch),
then, once that work is done too, its final action.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

__all__ = ["Epoch", "EpochManager", "EpochStatus"]

Action = Callable[[], None]


class EpochStatus(enum.Enum):
    """Life of an epoch."""

    OPEN = "open"
    CLOSED = "closed"
    FINISHING = "finishing"
    FINISHED = "finished"


class Epoch:
    """A span of records between two non-record events."""

    __slots__ = ("epoch_id", "final_action", "ongoing_record_count", "status", "trigger_action")

    def __init__(self, epoch_id: int) -> None:
        self.epoch_id = epoch_id
        self.ongoing_record_count = 0
        self.trigger_action: Action | None = None
        self.final_action: Action | None = None
        self.status = EpochStatus.OPEN

    def __repr__(self) -> str:
        return (f"<Epoch {self.epoch_id} {self.status.value} "
                f"records={self.ongoing_record_count}>")

    def join_while_finishing(self) -> bool:
        """Count one more record in this epoch if it is finishing (work that one of its
        records started after the trigger action, such as a timer firing registered by a
        firing): True if it joined; the caller gives the record this epoch."""
        if self.status is not EpochStatus.FINISHING:
            return False
        self.ongoing_record_count += 1
        return True

class EpochManager:
    """Assigns records to epochs and runs non-record actions in order."""

    __slots__ = ("_epoch_num", "_finishing", "_recursive", "active_epoch", "output_queue")

    def __init__(self) -> None:
        self._epoch_num = 0
        self.active_epoch = Epoch(0)
        self.output_queue: deque[Epoch] = deque()
        self._finishing: Epoch | None = None
        self._recursive = False

    def __repr__(self) -> str:
        return (f"<EpochManager active={self.active_epoch!r} "
                f"closed={len(self.output_queue)}>")

    def on_record(self) -> Epoch:
        """Join a record to the finishing epoch (work spawned by its trigger) or the open one."""
        epoch = self._finishing if self._finishing is not None else self.active_epoch
        epoch.ongoing_record_count += 1
        return epoch

    def on_non_record(self, trigger_action: Action | None, final_action: Action | None) -> None:
        """Close the open epoch with these actions and open the next one."""
        closing = self.active_epoch
        closing.trigger_action = trigger_action
        closing.final_action = final_action
        closing.status = EpochStatus.CLOSED
        self.output_queue.append(closing)
        self._epoch_num += 1
        self.active_epoch = Epoch(self._epoch_num)
        self.try_finish_in_queue()

    def complete_one_record(self, epoch: Epoch) -> None:
        """A record of `epoch` finished."""
        epoch.ongoing_record_count -= 1
        if epoch.ongoing_record_count == 0 and epoch is not self.active_epoch:
            self.try_finish_in_queue()

    def try_finish_in_queue(self) -> None:
        """Finish closed epochs from the head of the queue while they can finish: a closed
        epoch with no records left runs its trigger action (work it starts joins this epoch),
        then, once that work is done too, its final action. A finished epoch leaves the queue
        before its final action runs, so work the final action starts joins the open epoch
        and an epoch it closes queues behind."""
        if self._recursive:
            return
        self._recursive = True
        try:
            queue = self.output_queue
            while queue:
                head = queue[0]
                if head.ongoing_record_count != 0:
                    break
                if head.status is EpochStatus.CLOSED:
                    head.status = EpochStatus.FINISHING
                    if head.trigger_action is not None:
                        self._finishing = head
                        try:
                            head.trigger_action()
                        finally:
                            self._finishing = None
                    if head.ongoing_record_count != 0:
                        break
                head.status = EpochStatus.FINISHED
                queue.popleft()
                if head.final_action is not None:
                    head.final_action()
        finally:
            self._recursive = False
