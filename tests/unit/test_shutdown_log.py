"""What ``moepipe stop`` reads from Triton's log while it shuts down: the countdown lines of
tritonserver 2.51 (http_server.cc, server.cc, model_lifecycle), copied from real logs."""

from moepipe.deploy.local.drain import ShutdownLog as _ShutdownLog

DRAINING = '''Signal (15) received.
I1201 06:18:07.679043 5949 http_server.cc:248] "Timeout 30: Found 1 HTTP service connections"
I1201 06:18:08.679171 5949 http_server.cc:248] "Timeout 29: Found 1 HTTP service connections"
'''
IN_FLIGHT = '''I1201 06:18:37.689826 5949 server.cc:305] "Waiting for in-flight requests to complete."
I1201 06:18:37.689890 5949 server.cc:321] "Timeout 0: Found 1 model versions that have in-flight inferences"
I1201 06:18:37.689897 5949 server.cc:325] "Model 'ensemble' (version 1) has 1 in-flight inferences"
'''
DRAINED = 'I1201 06:18:09.1 5949 http_server.cc:248] "Timeout 28: Found 0 HTTP service connections"\n'
EXPIRED = ('E1201 06:18:37.689906 5949 main.cc:535] "failed to stop server: Internal - Exit '
           'timeout expired. Exiting immediately."\n')


def _log(tmp_path, before=""):
    path = tmp_path / "tritonserver.log"
    path.write_text(before)
    return path, _ShutdownLog(path)


def test_what_triton_waits_for_is_read_from_its_countdown(tmp_path):
    path, log = _log(tmp_path, "I1201 startup lines before the SIGTERM are not read\n" + DRAINING)
    log.read()
    assert log.waiting_for is None  # written before stop looked
    with open(path, "a") as f:
        f.write(DRAINING)
    log.read()
    assert log.waiting_for == "1 HTTP service connections" and not log.unloading
    with open(path, "a") as f:
        f.write(DRAINED)
    log.read()
    assert log.waiting_for is None
    with open(path, "a") as f:
        f.write(IN_FLIGHT + EXPIRED)
    log.read()
    assert log.waiting_for == "1 model versions that have in-flight inferences"
    assert log.timed_out


def test_a_half_written_line_is_read_once_complete(tmp_path):
    path, log = _log(tmp_path)
    line = DRAINING.splitlines()[1]
    with open(path, "a") as f:
        f.write(line[:40])
    log.read()
    assert log.waiting_for is None
    with open(path, "a") as f:
        f.write(line[40:] + "\n")
    log.read()
    assert log.waiting_for == "1 HTTP service connections"
