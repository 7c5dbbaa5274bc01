"""An engine served in-process on plain HTTP (the tests that set the server's own options,
such as its output parsers), and a model directory that differs from another only in its chat
template."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from prefix_index.tools.redis_process import free_port


@contextlib.contextmanager
def served_in_process(model_dir: Path, **options) -> Iterator[str]:
    """The model served by an EngineServer on a thread of its own with ServerOptions
    `options` (plain HTTP); yields the OpenAI API's base URL."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=256))
    http_port, ready, stop = free_port(), threading.Event(), []

    async def serve() -> None:
        server = EngineServer(engine, ServerOptions(port=0, http_port=http_port, **options))
        await server.start()
        stopped = asyncio.Event()
        stop.append((asyncio.get_running_loop(), stopped))
        ready.set()
        await stopped.wait()
        await server.stop(0)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(120)
    try:
        yield f"http://127.0.0.1:{http_port}/v1"
    finally:
        loop, stopped = stop[0]
        loop.call_soon_threadsafe(stopped.set)
        thread.join(30)


def with_chat_template(model_dir: Path, out: Path, template: str) -> Path:
    """`out`: `model_dir`'s files (linked) but for its chat template, `template`."""
    for item in model_dir.iterdir():
        if item.name != "chat_template.jinja":
            (out / item.name).symlink_to(item)
    (out / "chat_template.jinja").write_text(template)
    return out
