"""A real PostgreSQL server in a folder of its own: to try a team's shared ledger on one machine, and for the tests
and the bench kit's replica bench. Standard library only: `.ci/run` runs this file before any virtual environment
exists.

    python3 src/privlm/accounting/postgres_server.py start DIR   # initdb, pg_ctl start on a free port; prints the URL
    python3 src/privlm/accounting/postgres_server.py stop DIR
    python -m privlm.accounting.postgres_server start DIR        # the same, installed

The server trusts local connections (it listens on 127.0.0.1 and a socket in DIR only) and runs as the
``postgres`` user when this is root, since PostgreSQL refuses to run as root. Tests take
``$PRIVLM_TEST_POSTGRES_URL`` (a server `.ci/run` started) or start one here; with no PostgreSQL installed they
fail with the way to install it, never skip.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

URL_ENV = "PRIVLM_TEST_POSTGRES_URL"
INSTALL_HINT = ("PostgreSQL's server programs (initdb, pg_ctl) were not found on PATH or in /usr/lib/postgresql/*/bin. "
                "Install them (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql), or point "
                f"${URL_ENV} at a server whose user may create databases.")


class PostgresMissingError(RuntimeError):
    pass


def server_programs() -> Path:
    """The folder of ``initdb`` and ``pg_ctl``."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    raise PostgresMissingError(INSTALL_HINT)


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", _server_user(), "--", *command]


def _server_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresMissingError("running as root, and there is no 'postgres' user to run the server as")


def _run(command: list[str]) -> None:
    done = subprocess.run(_as_server_user(command), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PostgresServer:
    """One server whose data, socket and log live in ``folder``."""

    def __init__(self, folder: str | Path | None = None, *, durable: bool = False) -> None:
        # Its own folder under the temporary root by default: the server user (not root) must reach it, and
        # pytest's folders are root's alone.
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="privlm-postgres-"))
        self.data = self.folder / "data"
        self.durable = durable  # tests need no durability; a benchmark of commit latency does (fsync on)
        self.port_file = self.folder / "port"

    @property
    def port(self) -> int:
        return int(self.port_file.read_text())

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> str:
        """Make the cluster if it is new, start the server, wait until it answers; its URL."""
        programs = server_programs()
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam(_server_user())
            os.chown(self.folder, user.pw_uid, user.pw_gid)
        if not self.data.exists():
            self.port_file.write_text(str(_free_port()))
            _run([str(programs / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync",
                  "-E", "UTF8", "--locale=C"])
        # Room for every test worker's pools (up to 8 connections each) on a machine with many cores.
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=300"
        if not self.durable:
            options += " -c fsync=off"
        _run([str(programs / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"), "-o", options, "-w",
              "-t", "60", "start"])
        self._wait()
        return self.url

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(_as_server_user([str(server_programs() / "pg_ctl"), "-D", str(self.data), "-m", mode,
                                        "-w", "stop"]), check=False, capture_output=True)

    def remove(self) -> None:
        """Stop the server at once and delete its folder (data, socket, log)."""
        self.stop(mode="immediate")
        shutil.rmtree(self.folder, ignore_errors=True)

    def _wait(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"PostgreSQL did not start in {timeout:.0f} s; see {self.folder / 'log'}")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    server = PostgresServer(argv[1])
    if argv[0] == "stop":
        server.stop()
        return 0
    try:
        print(server.start())
    except (PostgresMissingError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
