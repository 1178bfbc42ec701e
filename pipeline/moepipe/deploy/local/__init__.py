"""The local deployment: a real ``tritonserver`` on loopback (:mod:`.binary`: which one, with
which environment), the record of it (:mod:`.state`), its processes found from ``/proc``
(:mod:`.processes`), what a stopping server shows (:mod:`.drain`) and the supervisor that
restarts it (:mod:`.supervisor`). The face: :mod:`moepipe.deploy.local.lifecycle` (start,
status, stop)."""
