"""A test double of `kubectl port-forward`, written as an executable named `kubectl` into a folder.

It records its arguments and pid, then relays 127.0.0.1:<local> (from its last argument, "<local>:<remote>")
to 127.0.0.1:$FAKE_KUBECTL_UPSTREAM, the way kubectl relays to a pod. FAKE_KUBECTL_MODE=fail exits at once
with kubectl's message for a missing Service; FAKE_KUBECTL_MODE=hang never listens.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

SCRIPT = """#!{python}
import json, os, socket, sys, threading, time

with open(os.environ["FAKE_KUBECTL_RECORD"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "pid": os.getpid()}}, f)
mode = os.environ.get("FAKE_KUBECTL_MODE", "relay")
if mode == "fail":
    print('error: services "minedraft-scheduler" not found', file=sys.stderr)
    sys.exit(1)
if mode == "hang":
    time.sleep(3600)
local, remote = sys.argv[-1].split(":")
upstream = int(os.environ["FAKE_KUBECTL_UPSTREAM"])
server = socket.create_server(("127.0.0.1", int(local)))
print(f"Forwarding from 127.0.0.1:{{local}} -> {{remote}}", flush=True)


def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


while True:
    conn, _ = server.accept()
    print("Handling connection for", local, flush=True)
    up = socket.create_connection(("127.0.0.1", upstream))
    threading.Thread(target=pump, args=(conn, up), daemon=True).start()
    threading.Thread(target=pump, args=(up, conn), daemon=True).start()
"""


def write_fake_kubectl(directory: Path) -> Path:
    """Write the double as `<directory>/kubectl` (executable) and return its path."""
    path = directory / "kubectl"
    path.write_text(SCRIPT.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def recorded(record: Path) -> dict:
    """What the double recorded: {"argv": [...], "pid": int}."""
    return json.loads(record.read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
