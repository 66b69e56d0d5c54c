"""The engine loop: apply commands at iteration boundaries, step, send each step's result.

One loop for both clients: :class:`~iterserve.engine.process_engine.ProcessEngine` runs it in a
child process over pipes, :class:`~iterserve.engine.async_engine.AsyncEngine` on a thread over
a queue. It speaks only the messages of :mod:`iterserve.engine.messages`. With a KV-events
publisher it also publishes, once per iteration that changed the prefix cache, that
iteration's events (``--kv-events-port``, :mod:`iterserve.kv_events`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.llm_engine import IterationError, LLMEngine
from iterserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CallResult,
    EngineCommand,
    EngineMessage,
    EngineReady,
    QueryLoad,
    RequestDelta,
    RequestError,
    RequestFailedError,
    Shutdown,
    StepResult,
    UpdateSchedulerConfig,
)
from iterserve.kv_events import KVEventPublisher
from iterserve.telemetry.iterations import IterationRecorder

logger = logging.getLogger(__name__)

# recv(block): the next command; None when ``block`` is False and none is pending.
Receive = Callable[[bool], EngineCommand | None]
Send = Callable[[EngineMessage], None]


class EngineCore:
    """Runs an :class:`LLMEngine` for one client.

    Args:
        engine: the engine; only this loop touches it from now on.
        send: delivers a message to the client (pipe send, or a hand-over to its event loop).
        recorder: where each iteration's ``scheduler_iterations`` row goes
            (``--telemetry-db``; queued without waiting), or None.
        kv_publisher: where each iteration's KV-cache events go (queued without waiting;
            the caller closes it), or None: the engine records none.
    """

    def __init__(
        self,
        engine: LLMEngine,
        send: Send,
        recorder: IterationRecorder | None = None,
        kv_publisher: KVEventPublisher | None = None,
    ) -> None:
        self.engine = engine
        self.send = send
        self.recorder = recorder
        self.kv_publisher = kv_publisher
        if kv_publisher is not None:
            engine.enable_kv_events()
        self._num_sent_iterations = engine.num_iterations
        self._errors: list[RequestError] = []

    def run(self, recv: Receive) -> None:
        """Send :class:`EngineReady`, then loop until :class:`Shutdown`.

        Commands are applied at iteration boundaries, all that are pending; an idle engine
        blocks for the next one. An idle engine that applied commands (an abort) sends the
        new counts too, so the client's view is never staler than one message.
        """
        engine = self.engine
        self.send(EngineReady(engine.config, engine.limits, engine.model_dir, engine.load()))
        dirty = False
        while True:
            idle = not engine.has_unfinished_requests()
            command = recv(idle and not dirty)
            if command is not None:
                dirty = True
                if not self.apply(command):
                    return
                continue
            if idle:
                self._send_result([])
                dirty = False
                continue
            self.step()
            dirty = False

    def apply(self, command: EngineCommand) -> bool:
        """Apply one command; False once it was :class:`Shutdown` (everything aborted)."""
        engine = self.engine
        if isinstance(command, AddRequest):
            try:
                engine.add(command)
            except (ValueError, InvalidRequestError) as e:  # an id in use
                self._errors.append(RequestError(command.request_id, e))
        elif isinstance(command, AbortRequests):
            engine.abort(command.request_ids)
        elif isinstance(command, UpdateSchedulerConfig):
            try:
                engine.update_scheduler_config(command.config)
            except Exception as e:
                self.send(CallResult(command.call_id, error=e))
            else:
                self.send(CallResult(command.call_id))
        elif isinstance(command, QueryLoad):
            self.send(CallResult(command.call_id, engine.load()))
        elif isinstance(command, Shutdown):
            engine.abort_all()
            return False
        else:
            logger.error("unknown engine command %r dropped", type(command).__name__)
        return True

    def step(self) -> None:
        """One iteration; its result goes to the client. A failing forward fails only the
        requests it carried; a bug outside the forward ends every request, not the loop."""
        engine = self.engine
        try:
            outputs = engine.step_deltas()
        except IterationError as e:
            error = RequestFailedError(f"{type(e.cause).__name__}: {e.cause}")
            self._errors += [RequestError(i, error) for i in e.request_ids]
            outputs = []
        except Exception as e:
            logger.exception("engine step failed; aborting every request")
            error = RequestFailedError(f"internal engine error ({type(e).__name__})")
            self._errors += [RequestError(d.request_id, error) for d in engine.abort_all()]
            outputs = []
        self._send_result(outputs)

    def _send_result(self, outputs: list[RequestDelta]) -> None:
        engine = self.engine
        telemetry = engine.telemetry_since(self._num_sent_iterations)
        self._num_sent_iterations = engine.num_iterations
        errors, self._errors = self._errors, []
        num_dropped = 0
        if self.recorder is not None:
            first_id = engine.num_iterations - len(telemetry) + 1
            num_dropped = self.recorder.record(first_id, telemetry)
        if self.kv_publisher is not None:
            kv_events = engine.take_kv_events()
            if kv_events:
                self.kv_publisher.publish(kv_events)
        num_kv_dropped = self.kv_publisher.num_dropped_batches if self.kv_publisher else 0
        self.send(
            StepResult(outputs, engine.load(), telemetry, errors, num_dropped, num_kv_dropped)
        )
