"""Test the buffer timeout without waiting: `ManualScheduler` stands in for the event loop's
`call_later`, so time moves only when the test advances it."""

import asyncstate as ast
from asyncstate.testing import ManualExecutor, ManualScheduler

executor = ManualExecutor()
scheduler = ManualScheduler()
controller = ast.AsyncExecutionController(
    executor, batch_size=100, buffer_timeout_ms=50, max_in_flight=10,
    timeout_scheduler=scheduler)
descriptor = ast.ValueStateDescriptor("v")
state = ast.ValueState(descriptor, controller,
                       executor.register_state(descriptor.name, descriptor.kind))

controller.set_current_context(controller.build_context("record", "k"))
read = state.value()
controller.set_current_context(None)
print("queued:", controller.active_queue_size, "scheduled calls:", scheduler.pending_num)

scheduler.advance(0.049)  # seconds: just before the 50 ms timeout
print("after 49 ms, batches sent:", executor.pending_batch_num)
scheduler.advance(0.001)
print("after 50 ms, batches sent:", executor.pending_batch_num)

executor.complete_all()
print("read:", read.result(), "in flight:", controller.in_flight_record_num)
