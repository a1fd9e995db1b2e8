"""The engine as a Ray actor and the API as a Ray Serve deployment, on one node.

The same engine (``engine.py``'s :class:`Engine` and step loop) runs in a Ray
actor, on the actor's event loop, which also answers the imports of the
fences it exports. The same API app (``api_server.py``) is the ingress of a
Serve deployment; its engine client speaks to the actor through Ray calls
instead of a socket pair: ``tell`` carries requests, cancels and acks, and
``take`` (a long poll) carries the steps, each with its fence token. The
tokens themselves still come through the ring in shared memory, so the actor
is placed on the replica's node; a fence token that reached another node
would be refused at import (``TokenRefusedError``, at once, never a hang),
and its streams would end with an error event saying so.

    python ray_app.py [--port 8000] [--device auto|opencl|torch|cuda|cpu]
        [--wait fence|synchronize] [--num-cpus 2]

starts a local Ray, deploys, prints ``serving on http://127.0.0.1:PORT/``,
and serves until Ctrl-C or SIGTERM, then prints ``shut down``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from api_server import EngineClient, make_app  # noqa: E402

import asyncfence  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI


class ActorLink:
    """The engine's end of its link to the API replica, inside the actor: two mailboxes."""

    def __init__(self) -> None:
        self.closed = False
        self.finished = False  # the step loop returned
        self._inbox: list[tuple[Any, ...]] = []
        self._outbox: list[tuple[Any, ...]] = []
        self._input = asyncio.Event()
        self._output = asyncio.Event()

    # The engine's side (engine.Link).
    def send(self, message: tuple[Any, ...]) -> None:
        self._outbox.append(message)
        self._output.set()

    async def flush(self) -> None:
        """Nothing to do: the replica's ``take`` collects the outbox."""

    def take(self) -> list[tuple[Any, ...]]:
        messages, self._inbox = self._inbox, []
        self._input.clear()
        return messages

    async def wait(self) -> None:
        await self._input.wait()

    # The actor's methods' side.
    def deliver(self, messages: list[tuple[Any, ...]]) -> None:
        self._inbox += messages
        self._input.set()

    def hang_up(self) -> None:
        self.closed = True
        self._input.set()

    def end(self) -> None:
        self.finished = True
        self._output.set()

    async def collect(self) -> list[tuple[Any, ...]] | None:
        """The engine's next messages; ``None`` once its step loop has returned."""
        while not self._outbox:
            if self.finished:
                return None
            await self._output.wait()
            self._output.clear()
        messages, self._outbox = self._outbox, []
        return messages


@ray.remote(num_cpus=0)
class EngineActor:
    """The engine in a Ray actor: its event loop runs the steps and answers the imports."""

    def __init__(self, arguments: list[str], foreign: bool) -> None:
        from bigram import open_runner
        from engine import Engine, open_ring, run

        options = _engine_options(arguments)
        self.link = ActorLink()
        runner = open_runner(options["device"], options["rows"])
        self.engine = Engine(
            self.link,
            open_ring(options["ring"], options["slots"], options["rows"]),
            runner,
            wait=options["wait"],
            in_flight=4,
            step_s=options["step_ms"] / 1000,
            fail_at=options["fail_at_step"],
            stall_at=None,
        )
        self.info = {
            "device": runner.description,
            "done_when_recorded": runner.done_when_recorded,
            "rows": options["rows"],
            "slots": options["slots"],
            "wait": options["wait"],
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
        }
        self._run = run
        self._foreign = foreign
        self._task: asyncio.Task[int] | None = None

    async def start(self) -> None:
        """Run the step loop on this actor's event loop until the replica hangs up."""
        if self._foreign:  # fault injection, for the tests: as if sent from another node
            send = self.link.send

            def from_elsewhere(message: tuple[Any, ...]) -> None:
                if message[0] == "step" and message[3] is not None:
                    token = dataclasses.replace(message[3], host="another-node")
                    message = (*message[:3], token, *message[4:])
                send(message)

            self.link.send = from_elsewhere  # type: ignore[method-assign]
        self._task = asyncio.get_running_loop().create_task(self._run(self.engine, self.info))
        self._task.add_done_callback(lambda _: self.link.end())

    async def tell(self, messages: list[tuple[Any, ...]]) -> None:
        self.link.deliver(messages)

    async def take(self) -> list[tuple[Any, ...]] | None:
        return await self.link.collect()

    async def hang_up(self) -> None:
        self.link.hang_up()


def _engine_options(arguments: list[str]) -> dict[str, Any]:
    """``engine.py``'s options, as :meth:`EngineClient.engine_args` writes them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ring", required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--wait", default="fence")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--fail-at-step", type=int)
    return vars(parser.parse_args(arguments))


class RayEngineClient(EngineClient):
    """The API side's engine client, speaking to an :class:`EngineActor` through Ray calls."""

    def __init__(self, *, foreign: bool = False, **settings: Any) -> None:
        super().__init__(**settings)
        self._foreign = foreign
        self._actor: Any = None
        self._actor_gone = False

    def _engine_running(self) -> bool:
        return self._actor is not None and not self._actor_gone

    @contextlib.asynccontextmanager
    async def _engine_started(self, ring_path: str) -> AsyncIterator[None]:
        # On this node: the ring is this node's shared memory.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        remote: Any = EngineActor  # ray.remote made it an actor class
        self._actor = remote.options(scheduling_strategy=here).remote(
            self.engine_args(ring_path), self._foreign
        )
        try:
            await self._actor.start.remote()
            yield
        finally:
            with contextlib.suppress(ray.exceptions.RayActorError):
                await self._actor.hang_up.remote()
            ray.kill(self._actor)

    async def _receive_batch(self) -> list[tuple[Any, ...]] | None:
        try:
            messages: list[tuple[Any, ...]] | None = await self._actor.take.remote()
        except ray.exceptions.RayActorError:
            messages = None
        if messages is None:
            self._actor_gone = True
        return messages

    async def _send_batch(self, messages: list[tuple[Any, ...]]) -> None:
        import anyio

        try:
            await self._actor.tell.remote(messages)
        except ray.exceptions.RayActorError:
            raise anyio.BrokenResourceError from None

    async def _hang_up(self) -> None:
        with contextlib.suppress(ray.exceptions.RayActorError):
            await self._actor.hang_up.remote()


def deployment(settings: dict[str, Any]) -> Any:
    """The API deployment: ``api_server``'s app, its engine an actor beside the replica."""

    def build_app() -> FastAPI:
        engine = RayEngineClient(**settings)
        return make_app(engine=engine, health_bound_s=settings.pop("health_bound_s", 5.0))

    return serve.deployment(serve.ingress(build_app)(), name="engine_api").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--wait", choices=("fence", "synchronize"), default="fence")
    parser.add_argument("--num-cpus", type=int, default=2, help="for the local Ray (default 2)")
    parser.add_argument("--fail-at-step", type=int, help="fault injection, for the tests")
    parser.add_argument(
        "--foreign-tokens", action="store_true", help="fault injection: tokens from another node"
    )
    args = parser.parse_args()
    # The replica and the actor import this folder's modules, and this asyncfence.
    path = os.pathsep.join(
        filter(
            None,
            [str(HERE), str(Path(asyncfence.__file__).parent.parent), os.environ.get("PYTHONPATH")],
        )
    )
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        object_store_memory=100 << 20,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        settings: dict[str, Any] = {"device": args.device, "wait": args.wait}
        if args.fail_at_step:
            settings["engine_args"] = [f"--fail-at-step={args.fail_at_step}"]
        if args.foreign_tokens:
            settings["foreign"] = True
        serve.run(deployment(settings).bind(), route_prefix="/")
        print(f"serving on http://127.0.0.1:{args.port}/", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    print("shut down", flush=True)


if __name__ == "__main__":
    main()
