"""Single-step the controller with `asyncstate.testing.ManualExecutor`: no event loop, no
sleeps; batches complete only when the test says so."""

import asyncstate as ast
from asyncstate.testing import ManualExecutor

executor = ManualExecutor()
# Without a running loop there is no timer for the buffer timeout: use 0 (none).
controller = ast.AsyncExecutionController(
    executor, batch_size=10, buffer_timeout_ms=0, max_in_flight=10)
descriptor = ast.ValueStateDescriptor("count")
count = ast.ValueState(descriptor, controller,
                       executor.register_state(descriptor.name, descriptor.kind))


def show(label):
    print(f"{label}: in_flight={controller.in_flight_record_num} "
          f"active={controller.active_queue_size} blocking={controller.blocking_queue_size} "
          f"occupied_keys={controller.occupied_key_num}")


first = controller.build_context("record-1", "k")
controller.set_current_context(first)
write = count.update(1)
read = count.value()
second = controller.build_context("record-2", "k")  # same key: waits for the first
controller.set_current_context(second)
later = count.value()
controller.set_current_context(None)
show("issued")

controller.trigger_if_needed(True)
print("pending:", [[r.request_type.name for r in b] for b in executor.pending_batches])
print("read done before delivery:", read.done())

executor.complete_next_batch()
print("first record read:", read.result())
show("first batch delivered")

controller.trigger_if_needed(True)
executor.complete_all()
print("second record read:", later.result())
show("all delivered")
