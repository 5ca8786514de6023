"""The keyed operator: drives a KeyedProcessFunction over a stream of records.

- `keyed`: `KeyedOperator`, its lifecycle and the wiring of its parts;
- `records`: turning input records into record contexts and running the function on them;
- `admission`: the back-pressure gate every record passes (`process()` and `run()`);
- `inbox`: records and events waiting to start from the controller's trampoline;
- `progress`: watermarks and processing time, where due timers fire;
- `checkpointing`: restore and snapshot of the operator's part of a checkpoint;
- `closing`: the close sequence (outstanding work failed, then the function and the backend);
- `functions`: the user function's side of the lifecycle (open, close, one operator at a time);
- `arguments`: checks of the public arguments, before any compiled code sees them;
- `run`: `ast.run`, a job over a list of records on a fresh event loop.
"""

from asyncstate.operator.keyed import KeyedOperator as KeyedOperator
from asyncstate.operator.progress import MAX_WATERMARK as MAX_WATERMARK
from asyncstate.operator.progress import MIN_WATERMARK as MIN_WATERMARK
from asyncstate.operator.run import run as run

__all__ = ["MAX_WATERMARK", "MIN_WATERMARK", "KeyedOperator", "run"]
