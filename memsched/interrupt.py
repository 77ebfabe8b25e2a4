"""Ctrl-C during a long search: the first stops it and keeps the best result so far, the
second aborts.

A SIGINT reaches Python's handler only when the main thread runs Python again, which a
CP-SAT solve (native code) may delay by many seconds. So the signal is also written to a
wake-up socket (`signal.set_wakeup_fd`) that a watcher thread reads at once: the first
signal stops the deadline (`Deadline.stop`, which stops the running solvers too). The
handler in the main thread counts too, and raises KeyboardInterrupt at the second, which
unwinds without writing anything (outputs are written atomically, so nothing is left
half-written).
"""
from __future__ import annotations

import signal
import socket
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from .deadline import Deadline


@contextmanager
def stop_on_interrupt(deadline: Deadline, first: Callable[[], None] = lambda: None) -> Iterator[None]:
    """While inside, the first Ctrl-C calls `first` (e.g. to say so) and stops `deadline`; a
    second raises KeyboardInterrupt in the main thread. Outside the main thread, or where
    signals cannot be watched, nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    reader.setblocking(True)
    writer.setblocking(False)
    try:
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        reader.close()
        writer.close()
        yield
        return
    done = threading.Event()
    lock = threading.Lock()

    def stop_once() -> None:
        with lock:
            if deadline.stopped:
                return
            first()
            deadline.stop()

    seen = []

    def handler(signum, frame) -> None:
        seen.append(signum)
        if len(seen) >= 2:
            raise KeyboardInterrupt
        stop_once()

    def watch() -> None:
        while not done.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if bytes([signal.SIGINT]) in data:
                stop_once()

    previous_handler = signal.signal(signal.SIGINT, handler)
    watcher = threading.Thread(target=watch, name="memsched-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        try:
            writer.send(b"\0")       # wakes the watcher, which sees `done`
        except OSError:
            pass
        watcher.join(timeout=1.0)
        writer.close()
        reader.close()
