"""Users, tokens and credentials (torchrelay/server/auth.py) over a real SQLite store; the route
rules (guard.rule_of) and durations (torchrelay/durations.py) as tables."""
import pytest

from torchrelay.durations import parse_duration
from torchrelay.errors import Conflict, InvalidSpec, NotFound, Unauthenticated
from torchrelay.server.auth import Credentials, check_user_name, digest_of
from torchrelay.server.guard import rule_of
from torchrelay.server.service import ClusterService


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("30d", 2592000),
                                           ("2w", 1209600), (" 1.5h ", 5400), ("30D", 2592000)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "30x", "-1d", "0", "thirty days", "1d2h"])
def test_bad_durations_name_the_value(text):
    with pytest.raises(InvalidSpec, match=f"duration {text!r}"):
        parse_duration(text)


@pytest.mark.parametrize("method, path, who", [
    ("GET", "/api/v1/health", {"public"}),
    ("GET", "/api/v1/jobs/{job_id}/artifacts/{path:path}", {"user", "worker"}),
    ("PUT", "/api/v1/jobs/{job_id}/artifacts/{path}", {"user", "worker"}),
    ("POST", "/api/v1/nodes/{node_id}/heartbeat", {"node"}),
    ("POST", "/api/v1/jobs/{job_id}/checkpoints", {"worker"}),  # a job's own worker, its attempt's token
    ("POST", "/api/v1/jobs", {"user"}),
    ("DELETE", "/api/v1/jobs/{job_id}", {"admin"}),   # no rule: admins only
    ("GET", "/api/v1/something-new", {"admin"}),
    ("GET", "/metrics", {"admin", "scraper"}),
])
def test_each_route_has_its_rule_and_an_unknown_one_is_for_admins(method, path, who):
    assert set(rule_of(method, path).who) == who


@pytest.mark.parametrize("name, ok", [("alice", True), ("a.b-c_d@x", True), ("", False), ("-x", False),
                                      ("a b", False), ("a/b", False), ("x" * 129, False)])
def test_user_names(name, ok):
    if ok:
        assert check_user_name(name) == name
    else:
        with pytest.raises(InvalidSpec, match="user name"):
            check_user_name(name)


@pytest.fixture
def creds(tmp_path, db_url):
    """Credentials over a fresh store: SQLite, and PostgreSQL where one runs."""
    now = [1000.0]
    svc = ClusterService(db_url, str(tmp_path / "store"), clock=lambda: now[0])
    yield Credentials(svc.db, lambda: now[0]), now, svc
    svc.db.dispose()


def test_the_first_admin_is_made_once(creds):
    c, _, _ = creds
    token = c.bootstrap_admin()
    assert token.startswith("rlu_") and len(token) == 4 + 43  # 32 random bytes, base64url
    assert c.bootstrap_admin() is None
    who = c.principal_of(token)
    assert (who.kind, who.name, who.admin) == ("user", "admin", True)


def test_tokens_are_checked_revoked_expired_and_end_with_their_user(creds):
    c, now, _ = creds
    c.add_user("alice")
    with pytest.raises(Conflict, match="'alice' exists"):
        c.add_user("alice")
    with pytest.raises(InvalidSpec, match="role 'root'"):
        c.add_user("bob", "root")
    info, text = c.create_token("user", user="alice", ttl_s=60)
    assert c.principal_of(text).name == "alice" and not c.principal_of(text).admin
    assert [t["id"] for t in c.tokens("alice")] == [info["id"]] and "token" not in c.tokens()[0]
    now[0] += 61
    with pytest.raises(Unauthenticated, match="expired"):
        c.principal_of(text)
    _, other = c.create_token("user", user="alice")
    c.revoke(c.principal_of(other).token_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        c.principal_of(other)
    _, third = c.create_token("user", user="alice")
    c.remove_user("alice")
    with pytest.raises(Unauthenticated):
        c.principal_of(third)
    with pytest.raises(Unauthenticated, match="not known"):
        c.principal_of("rlu_" + "A" * 43)
    with pytest.raises(NotFound, match="'nobody'"):
        c.create_token("user", user="nobody")


def test_only_digests_are_stored(tmp_path):
    svc = ClusterService(f"sqlite:///{tmp_path / 'state.db'}", str(tmp_path / "store"))
    c = Credentials(svc.db, svc.clock)
    text = c.bootstrap_admin()
    svc.db.dispose()  # everything written back to the file
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("state.db*"))
    assert text.encode() not in stored and digest_of(text).encode() in stored


def test_a_worker_token_is_of_one_job_and_attempt(creds):
    c, _, svc = creds
    job = svc.submit({"entrypoint": "python x.py"}, None, "alice").id
    with svc.db.write() as rows:
        rows.job(job).attempt, rows.job(job).state = 1, "RUNNING"
    token = c.worker_token(job, 1)
    assert token == c.worker_token(job, 1)  # nothing stored: the same each time
    who = c.principal_of(token)
    assert (who.kind, who.job_id, who.attempt) == ("worker", job, 1)
    with pytest.raises(Unauthenticated, match="ended with its attempt"):
        c.principal_of(c.worker_token(job, 2))
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    with pytest.raises(Unauthenticated, match="not one this server made"):
        c.principal_of(forged)
    # the attempt number stays until the job is placed again, but its workers are being stopped
    for state, live in (("SCHEDULED", True), ("CANCELLING", True), ("RESTARTING", False), ("QUEUED", False),
                        ("RUNNING", True), ("CANCELLED", False)):
        with svc.db.write() as rows:
            rows.job(job).state = state
        if live:
            assert c.principal_of(token).job_id == job, state
        else:
            with pytest.raises(Unauthenticated, match="ended with its attempt"):
                c.principal_of(token)
