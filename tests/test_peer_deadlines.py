"""Every wait on a peer has an overall deadline (issue 70, item 4): a server that drips one header line a second
(each read well inside any per-read timeout) is given up on when the deadline passes, with a ``PeerError`` naming the
URL and the deadline; so is a peer process that never answers."""
import queue
import socket
import threading
import time

import pytest

from lab.peer import server
from lab.peer.server import ServerRequest, check_server, run_server_workload
from lab.peer.waits import Deadline, PeerError, http


@pytest.fixture
def dripping_url():
    """A local HTTP server that answers every connection with a status line, then one header line a second, never
    ending its headers."""
    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)

    def drip(connection):
        with connection:
            try:
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\n")
                count = 0
                while not stop.wait(1.0):
                    count += 1
                    connection.sendall(f"X-Drip-{count}: {count}\r\n".encode())
            except OSError:
                pass  # the client gave up and closed

    def accept():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=drip, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()


def test_a_dripping_server_is_given_up_on_at_the_deadline(dripping_url):
    started = time.monotonic()
    with pytest.raises(PeerError, match=rf"GET {dripping_url}/v1/models: .*deadline of 1.5 s"):
        check_server(dripping_url, timeout_s=1.5)
    assert time.monotonic() - started < 6.0


def test_the_twin_cli_at_a_dripping_url_ends_naming_it(dripping_url, monkeypatch, capsys):
    from simulator.cli.main import main

    monkeypatch.setattr(server, "HTTP_DEADLINE_S", 1.5)
    started = time.monotonic()
    assert main(["twin", "--peer", "vllm", "--url", dripping_url]) == 2
    err = capsys.readouterr().err
    assert dripping_url in err and "deadline of 1.5 s" in err and "Traceback" not in err
    assert time.monotonic() - started < 30.0  # it ends (a per-read timeout alone never did)


def test_a_dripping_stream_fails_its_request_at_the_deadline(dripping_url, monkeypatch):
    monkeypatch.setattr(server, "CONNECT_TIMEOUT_S", 1.0)  # the /metrics readings around the run
    started = time.monotonic()
    run = run_server_workload(dripping_url, [ServerRequest([1, 2, 3], 4, 0.0)], model="m", poll_s=0.1,
                              stream_deadline_s=1.0)
    assert time.monotonic() - started < 6.0
    assert not run.complete
    assert any("request 0" in problem and "deadline of 1 s" in problem for problem in run.problems)


def test_nothing_listening_is_named():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PeerError, match=rf"no server answers at http://127.0.0.1:{port}/health"):
        http("GET", f"http://127.0.0.1:{port}/health", 2.0)


def test_a_silent_peer_process_is_given_up_on_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(PeerError, match=r"the vLLM peer \(x\): no complete answer within the deadline of 0.3 s"):
        Deadline(0.3, "the vLLM peer (x)").get(queue.Queue())
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), "5"])
def test_a_deadline_must_be_a_positive_number(seconds):
    with pytest.raises(PeerError, match="seconds"):
        Deadline(seconds, "x")
