"""Who may call what, on a real server process: every route of the OpenAPI document (read from the
document itself, so that a route added tomorrow is covered the day it comes) and the routes kept
out of it, with no token, another user's, a node's and another job's worker's; a scan of the
port; the CLI of two users; tokens' lifecycle; the bad-token rate limit."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import kill_group, serving
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import NotFound, Unauthenticated
from torchrelay.home import admin_token_file
from torchrelay.server.guard import RULES
from torchrelay.wire import Heartbeat, LaunchStatus, LaunchStatusReport, NodeRegistration

API = "/api/v1"
# routes outside the OpenAPI document (include_in_schema=False), listed here by hand
HIDDEN = [("GET", "/metrics"), ("GET", f"{API}/openapi.json"), ("GET", f"{API}/docs")]
PUBLIC = {("GET", f"{API}/health"), ("GET", "/")}


@dataclass
class World:
    address: str
    home: Path
    admin: str
    alice: str
    bob: str
    node: str
    node_id: str
    job_a: str  # alice's
    job_b: str  # bob's
    worker_a: str
    worker_b: str
    digest: str
    token_id: str


def _call(world: World, method: str, path: str, token: str | None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if method in ("POST", "PUT") and "json" not in kw and "content" not in kw:
        kw["json"] = {}
    return httpx.request(method, world.address + path, headers=headers, timeout=10, **kw)


def _beat(address: str, node_token: str, node_id: str, exited: str | None = None) -> dict:
    beat = Heartbeat(wait_s=0, statuses=[LaunchStatusReport(launch_id=exited, status=LaunchStatus(
        state="exited", succeeded=False, stopped=True))] if exited else [])
    r = httpx.post(f"{address}{API}/nodes/{node_id}/heartbeat", headers={"authorization": f"Bearer {node_token}"},
                   json=beat.model_dump(mode="json"), timeout=10)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    home = tmp_path_factory.mktemp("relay-auth")
    with serving(home, ("--heartbeat-timeout", "600")) as address:
        admin = admin_token_file(home).read_text().strip()
        with RelayClient(address, token=admin) as c:
            tokens = {}
            for name in ("alice", "bob"):
                c.admin.add_user(name)
                tokens[name] = c.admin.create_token(name)["token"]
            enrol = c.admin.enroll_token()["token"]
        with RelayClient(address, token=enrol) as c:
            reg = c._request("POST", "/nodes/register", json=NodeRegistration(
                name="n1", address="127.0.0.1", cpus=8, memory=2**33).model_dump(mode="json")).json()
        work = tmp_path_factory.mktemp("work")
        (work / "train.py").write_text("print('hi')\n")
        jobs = {}
        for name in ("alice", "bob"):
            with RelayClient(address, token=tokens[name]) as c:
                jobs[name] = c.submit({"entrypoint": "python train.py", "name": f"secret-{name}"}, base_dir=work).id
        digest = RelayClient(address, token=tokens["alice"]).job(jobs["alice"]).bundle
        workers: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while len(workers) < 2:
            assert time.monotonic() < deadline, "the jobs were not placed on the node"
            beat = _beat(address, reg["credential"], reg["node_id"])
            workers = {x["job_id"]: x["worker_token"] for x in beat["launches"]}
            time.sleep(0.1)
        with RelayClient(address, token=tokens["alice"]) as c:
            c._request("PUT", f"/jobs/{jobs['alice']}/artifacts/x.txt", content=b"alice's")
            token_id = c.admin.whoami()["token_id"]
        yield World(address, home, admin, tokens["alice"], tokens["bob"], reg["credential"], reg["node_id"],
                    jobs["alice"], jobs["bob"], workers[jobs["alice"]], workers[jobs["bob"]], digest, token_id)


def _routes(world: World) -> list[tuple[str, str]]:
    doc = _call(world, "GET", f"{API}/openapi.json", world.admin).json()
    found = [(m.upper(), p) for p, item in doc["paths"].items() for m in item
             if m in ("get", "post", "put", "delete", "head", "patch")]
    assert len(found) > 30, found
    return sorted(set(found) | set(HIDDEN))


def _filled(world: World, path: str, job: str | None = None) -> str:
    values = {"job_id": job or world.job_a, "node_id": world.node_id, "digest": world.digest, "path": "x.txt",
              "name": "nobody", "token_id": world.token_id}
    return re.sub(r"\{(\w+)(?::path)?\}", lambda m: values[m.group(1)], path)


def test_every_route_has_a_rule_of_its_own(world):
    missing = [r for r in _routes(world) if (r[0], r[1]) not in RULES]
    assert missing == [], "routes without a rule in torchrelay/server/guard.py RULES (they answer admins only)"


def test_every_route_but_health_needs_a_token(world):
    for method, path in _routes(world):
        r = _call(world, method, _filled(world, path), None)
        if (method, path) in PUBLIC:
            assert r.status_code == 200, (method, path)
        else:
            assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
            assert method == "HEAD" or r.json()["error"] == "Unauthenticated"


def test_another_users_job_is_answered_as_one_that_does_not_exist(world):
    job_routes = [(m, p) for m, p in _routes(world) if "{job_id}" in p and USER_TAKES(m, p)]
    assert len(job_routes) > 10
    for method, path in job_routes:
        theirs = _call(world, method, _filled(world, path), world.bob)
        missing = _call(world, method, _filled(world, path, "job-99999"), world.bob)
        assert theirs.status_code == 404, (method, path, theirs.status_code, theirs.text[:200])
        if method != "HEAD":
            assert theirs.json()["detail"] == missing.json()["detail"].replace("job-99999", world.job_a)


def USER_TAKES(method: str, path: str) -> bool:
    return "user" in RULES[(method, path.replace(":path}", "}"))].who


def test_a_node_credential_is_refused_where_a_user_is_needed_and_a_user_where_a_node_is(world):
    for method, path in _routes(world):
        who = RULES[(method, path.replace(":path}", "}"))].who
        if "public" in who:
            continue
        if "node" not in who:
            r = _call(world, method, _filled(world, path), world.node)
            assert r.status_code == 403, (method, path, r.status_code, r.text[:200])
        if "user" not in who and "admin" not in who:
            r = _call(world, method, _filled(world, path), world.alice)
            assert r.status_code == 403, (method, path, r.status_code, r.text[:200])


def test_a_worker_token_is_refused_for_another_job_and_for_what_only_users_do(world):
    for method, path in _routes(world):
        who = RULES[(method, path.replace(":path}", "}"))].who
        if "public" in who:
            continue
        r = _call(world, method, _filled(world, path), world.worker_b)
        if "{job_id}" in path or "worker" not in who:
            assert r.status_code == 403, (method, path, r.status_code, r.text[:200])
    own = _call(world, "GET", f"{API}/jobs/{world.job_a}/artifacts/x.txt", world.worker_a)
    assert own.status_code == 200 and own.content == b"alice's"
    assert _call(world, "PUT", f"{API}/jobs/{world.job_a}/artifacts/y.txt", world.worker_a,
                 content=b"by a worker").status_code == 200
    assert _call(world, "GET", f"{API}/jobs/{world.job_a}/logs", world.worker_a).status_code == 403


def test_a_user_sees_and_touches_only_their_own_jobs_through_the_api(world):
    with RelayClient(world.address, token=world.bob) as bob:
        assert [j.id for j in bob.jobs()] == [world.job_b]
        for call in (lambda: bob.job(world.job_a), lambda: bob.cancel(world.job_a),
                     lambda: bob.logs(world.job_a), lambda: bob.artifacts(world.job_a),
                     lambda: bob.artifact_bytes(world.job_a, "x.txt"),
                     lambda: bob._request("PUT", f"/jobs/{world.job_a}/artifacts/z.txt", content=b"bob was here")):
            with pytest.raises(NotFound, match=world.job_a):
                call()
        queue = bob.queue()
        assert all(row["name"] != "secret-alice" and row["id"] != world.job_a for row in queue)
        assert all(row["user"] in (None, "bob") and row["max_runtime_s"] is None for row in queue if row["id"] is None)
        with pytest.raises(Exception, match="only an admin"):
            bob.jobs(all_users=True)
        with pytest.raises(Exception, match="only an admin submits for another user"):
            bob.submit({"entrypoint": "python x.py", "user": "alice"}, upload=False)
    with RelayClient(world.address, token=world.alice) as alice:
        assert alice.job(world.job_a).state.value != "CANCELLED"
        assert [a.path for a in alice.artifacts(world.job_a)] == ["x.txt", "y.txt"] or \
            {a.path for a in alice.artifacts(world.job_a)} <= {"x.txt", "y.txt"}
    with RelayClient(world.address, token=world.admin) as admin:
        assert {world.job_a, world.job_b} <= {j.id for j in admin.jobs(all_users=True)}


def _relay(args: list[str], config: Path, address: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RELAY_CONFIG_DIR": str(config), "RELAY_ADDRESS": address, "COLUMNS": "200"}
    env.pop("RELAY_TOKEN", None)
    env["RELAY_HOME"] = str(config / "home")  # not the server's: the CLI must use what `login` stored
    return subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", *args], env=env, text=True,
                          capture_output=True, timeout=60)


def test_a_user_sees_and_touches_only_their_own_jobs_through_the_cli(world, tmp_path):
    config = tmp_path / "bob-config"
    login = _relay(["login", "--token", world.bob], config, world.address)
    assert login.returncode == 0 and "as bob" in login.stdout, login.stderr
    assert (config / "credentials.json").stat().st_mode & 0o777 == 0o600
    listed = _relay(["ls", "-o", "json"], config, world.address)
    assert listed.returncode == 0 and world.job_b in listed.stdout and world.job_a not in listed.stdout
    for args in (["status", world.job_a], ["logs", world.job_a], ["cancel", world.job_a],
                 ["download", world.job_a, str(tmp_path / "dest")]):
        out = _relay(args, config, world.address)
        assert out.returncode == 1 and f"job '{world.job_a}' does not exist" in out.stderr, (args, out.stderr)
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("*.txt"))
    refused = _relay(["ls", "--all"], config, world.address)
    assert refused.returncode == 1 and "only an admin" in refused.stderr
    nobody = _relay(["ls"], tmp_path / "nobody", world.address)
    assert nobody.returncode == 1 and "relay login" in nobody.stderr
    assert _relay(["logout"], config, world.address).returncode == 0
    after = _relay(["ls"], config, world.address)
    assert after.returncode == 1 and "a token is needed" in after.stderr


COMMON = ["/", "/admin", "/login", "/api", "/api/v1", "/api/v2/jobs", "/.env", "/config", "/debug", "/server-status",
          "/api/v1/admin", "/api/v1/users/admin", "/api/v1/tokens/x", "/docs", "/openapi.json", "/redoc",
          "/api/v1/redoc", "/ui", "/api/v1/jobs/job-1/../../../etc/passwd", "/metrics/", "/api/v1/../../etc/passwd"]


def test_a_scan_of_the_port_without_a_token_finds_only_health_open(world):
    paths = {_filled(world, p) for _, p in _routes(world)} | set(COMMON)
    open_ = []
    for path in sorted(paths):
        for method in ("GET", "POST", "PUT"):
            r = _call(world, method, path, None, follow_redirects=True)  # /metrics/ -> /metrics
            if r.status_code not in (401, 404, 405):
                open_.append((method, path, r.status_code))
    assert sorted(open_) == [("GET", "/", 200), ("GET", f"{API}/health", 200)]
    page = _call(world, "GET", "/", None).text
    assert "secret-alice" not in page and world.job_a not in page  # the shell holds no data


def test_revoked_and_expired_tokens_stop_at_once_and_tokens_are_hashed_at_rest(world):
    with RelayClient(world.address, token=world.admin) as admin:
        made = admin.admin.create_token("alice", label="short")
        brief = admin.admin.create_token("alice", expires_in_s=0.5)
    with RelayClient(world.address, token=made["token"]) as c:
        assert c.admin.whoami()["name"] == "alice"
        RelayClient(world.address, token=world.alice).admin.revoke_token(made["id"])
        with pytest.raises(Unauthenticated, match="revoked"):
            c.jobs()
    deadline = time.monotonic() + 10
    with RelayClient(world.address, token=brief["token"]) as c:
        while True:
            try:
                c.jobs()
            except Unauthenticated as exc:
                assert "expired" in str(exc)
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
    stored = b"".join(p.read_bytes() for p in world.home.glob("state.db*"))
    assert stored  # the file and its WAL
    for text in (world.admin, world.alice, world.bob, world.node, made["token"]):
        assert text.encode() not in stored
    assert admin_token_file(world.home).stat().st_mode & 0o777 == 0o600


def test_a_worker_token_dies_with_its_attempt(world):
    with RelayClient(world.address, token=world.admin) as c:
        job = c.submit({"entrypoint": "python x.py", "user": "alice"}, upload=False).id
        deadline = time.monotonic() + 30
        launch = None
        while launch is None:
            assert time.monotonic() < deadline
            launch = {x["job_id"]: x for x in _beat(world.address, world.node, world.node_id)["launches"]}.get(job)
        token = launch["worker_token"]
        assert _call(world, "GET", f"{API}/jobs/{job}", token).status_code == 200
        c.cancel(job, checkpoint=False)
        while not c.job(job).state.terminal:  # the node's next beats end the launch it never started
            assert time.monotonic() < deadline, c.job(job).state
            _beat(world.address, world.node, world.node_id, exited=launch["launch_id"])
            time.sleep(0.1)
        assert _call(world, "GET", f"{API}/jobs/{job}", token).status_code == 401


def test_the_admin_token_is_printed_at_the_first_start_only(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with serving(home):
        token = admin_token_file(home).read_text().strip()
        assert token.startswith("rlu_") and len(token) >= 4 + 43
    assert token in (home / "server.log").read_text()
    with serving(home) as address:
        assert "admin token" not in (home / "server.log").read_text()
        assert RelayClient(address, token=token).admin.whoami()["admin"] is True


def test_bad_tokens_past_the_limit_get_429_naming_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with serving(home) as address:
        good = admin_token_file(home).read_text().strip()
        codes = [httpx.get(f"{address}{API}/jobs", headers={"authorization": f"Bearer rlu_wrong{i}"}).status_code
                 for i in range(30)]
        assert set(codes) == {401}
        r = httpx.get(f"{address}{API}/jobs", headers={"authorization": "Bearer rlu_wrong"})
        assert r.status_code == 429 and "30 bad tokens" in r.json()["detail"]
        # a good token from that address still passes (an agent shares its address with jobs); health stays open
        assert httpx.get(f"{address}{API}/jobs", headers={"authorization": f"Bearer {good}"}).status_code == 200
        assert httpx.get(f"{address}{API}/jobs", headers={"authorization": "Bearer rlu_wrong"}).status_code == 429
        assert httpx.get(f"{address}{API}/health").status_code == 200


def test_the_cluster_event_stream_carries_only_the_users_own_jobs(world):
    with httpx.stream("GET", f"{world.address}{API}/events/stream", params={"after": 0}, timeout=10,
                      headers={"authorization": f"Bearer {world.bob}"}) as resp:
        assert resp.status_code == 200
        data = next(line for line in resp.iter_lines() if line.startswith("data: "))
    assert world.job_b in data and world.job_a not in data


def test_an_agent_enrols_once_and_reuses_its_own_credential(world, tmp_path):
    with RelayClient(world.address, token=world.admin) as c:
        enrol = c.admin.enroll_token(label="test")
    work = tmp_path / "agent"
    env = {**os.environ, "RELAY_HOME": str(tmp_path / "home"), "RELAY_CONFIG_DIR": str(tmp_path / "config"),
           "RELAY_ENROLL_TOKEN": enrol["token"], "RELAY_AGENT_ZYGOTE": "0"}
    env.pop("RELAY_TOKEN", None)

    def run_agent(env: dict, round_: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "torchrelay.client.cli.main", "agent",
                                 "--address", world.address, "--name", "enrolled", "--cpus", "1", "--work-dir", str(work), "--cgroups", "off",
                                 "--label", f"round={round_}"],
                                env=env, stdout=open(tmp_path / "agent.log", "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def node_ids(round_: int) -> set[str]:
        with RelayClient(world.address, token=world.admin) as c:
            return {n.id for n in c.nodes() if n.name == "enrolled" and n.labels.get("round") == str(round_)}

    def wait_for(predicate) -> None:
        deadline = time.monotonic() + 60
        while not predicate():
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()[-3000:]
            time.sleep(0.1)

    agent = run_agent(env, 1)
    try:
        wait_for(lambda: len(node_ids(1)) == 1 and (work / "node.credential").exists())
        first = node_ids(1)
        credential = (work / "node.credential").read_text()
        assert credential.startswith("rln_") and (work / "node.credential").stat().st_mode & 0o777 == 0o600
        kill_group(agent.pid)
        agent.wait(timeout=10)
        with RelayClient(world.address, token=world.admin) as c:  # the enrolment token is gone...
            c.admin.revoke_token(enrol["id"])
        del env["RELAY_ENROLL_TOKEN"]
        agent = run_agent(env, 2)  # ...and the agent comes back with its own credential, as the same node
        wait_for(lambda: node_ids(2) == first)
        assert (work / "node.credential").read_text() == credential
        with RelayClient(world.address, token=credential) as as_node:
            with pytest.raises(Exception, match="takes a credential of: user"):
                as_node.submit({"entrypoint": "python x.py"}, upload=False)
    finally:
        kill_group(agent.pid)
        agent.wait(timeout=10)


def test_an_admin_manages_users_tokens_and_enrolment_through_the_cli(world, tmp_path):
    admin = tmp_path / "admin-config"
    assert _relay(["login", "--token", world.admin], admin, world.address).returncode == 0
    added = _relay(["user", "add", "carol", "--expires", "1d"], admin, world.address)
    assert added.returncode == 0, added.stderr
    carol_token = re.search(r"(rlu_\S+)", added.stdout.replace("\n", "")).group(1)
    users = json.loads(_relay(["user", "ls", "-o", "json"], admin, world.address).stdout)
    assert {"name": "carol", "role": "user"}.items() <= next(u for u in users if u["name"] == "carol").items()
    carol = tmp_path / "carol-config"
    assert "as carol" in _relay(["login", "--token", carol_token], carol, world.address).stdout
    made = _relay(["token", "create", "--label", "laptop", "--expires", "2h"], carol, world.address)
    assert made.returncode == 0 and made.stdout.strip().splitlines()[-1].startswith("rlu_")
    listed = json.loads(_relay(["token", "ls", "-o", "json"], carol, world.address).stdout)
    assert {t["user"] for t in listed} == {"carol"} and all("token" not in t for t in listed)
    laptop = next(t for t in listed if t["label"] == "laptop")
    assert _relay(["token", "revoke", laptop["id"]], carol, world.address).returncode == 0
    assert _relay(["user", "add", "mallory"], carol, world.address).stderr.count("admin") >= 1
    assert _relay(["token", "revoke", world.token_id], carol, world.address).returncode == 1  # alice's
    enrol = _relay(["node", "enroll-token", "--expires", "1h"], admin, world.address)
    assert enrol.returncode == 0 and enrol.stdout.strip().splitlines()[-1].startswith("rle_")
    bad = _relay(["token", "create", "--expires", "soon"], carol, world.address)
    assert bad.returncode == 1 and "duration 'soon'" in bad.stderr
    assert _relay(["user", "rm", "carol"], admin, world.address).returncode == 0
    gone = _relay(["ls"], carol, world.address)
    assert gone.returncode == 1 and "was removed" in gone.stderr


def test_metrics_are_for_admins_and_scrapers_only(world):
    with RelayClient(world.address, token=world.admin) as c:
        c.admin.add_user("prometheus", "scraper")
        scraper = c.admin.create_token("prometheus")["token"]
    assert _call(world, "GET", "/metrics", scraper).status_code == 200
    assert "torchrelay_jobs" in _call(world, "GET", "/metrics", world.admin).text
    assert _call(world, "GET", "/metrics", world.alice).status_code == 403  # job names of everyone
    for method, path in [("GET", f"{API}/jobs"), ("GET", f"{API}/nodes"), ("POST", f"{API}/jobs")]:
        assert _call(world, method, path, scraper).status_code == 403


def test_the_embedded_clusters_server_log_is_private(cluster_factory):
    cluster = cluster_factory(0)
    log = cluster.home / "logs" / "server.log"
    assert admin_token_file(cluster.home).read_text().strip() in log.read_text()  # printed there, once...
    assert log.stat().st_mode & 0o777 == 0o600  # ...so only its owner reads it


def test_an_enrolment_token_makes_a_new_node_and_cannot_take_over_a_known_one(world):
    with RelayClient(world.address, token=world.admin) as c:
        enrol = c.admin.enroll_token(label="takeover")["token"]
    body = NodeRegistration(name="n1", address="127.0.0.1", cpus=8, memory=2**33,
                            node_id=world.node_id).model_dump(mode="json")
    reply = httpx.post(f"{world.address}{API}/nodes/register", json=body, timeout=10,
                       headers={"authorization": f"Bearer {enrol}"})
    assert reply.status_code == 200 and reply.json()["node_id"] != world.node_id
    # the known node's own credential still works, and its launches (their worker tokens) stayed its own
    beat = _beat(world.address, world.node, world.node_id)
    assert {x["job_id"] for x in beat["launches"]} >= {world.job_a, world.job_b}
    stolen = _beat(world.address, reply.json()["credential"], reply.json()["node_id"])
    assert stolen["launches"] == []


def test_a_body_past_the_request_limit_is_refused_before_anything_reads_it(world):
    big = b'{"spec": {"entrypoint": "' + b"x" * (9 << 20) + b'"}}'
    reply = httpx.post(f"{world.address}{API}/jobs", content=big, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413 and "limits.request" in reply.json()["detail"]


def test_a_node_posts_logs_and_metrics_only_under_its_own_launch_of_that_job(world):
    launches = {x["job_id"]: x["launch_id"] for x in _beat(world.address, world.node, world.node_id)["launches"]}
    own, other = launches[world.job_a], launches[world.job_b]
    node = {"authorization": f"Bearer {world.node}"}
    for kind, record in (("logs", {"rank": 0, "stream": "stdout", "seq": 10_000, "text": "x"}),
                         ("metrics", {"rank": 0, "seq": 10_000, "time": 1.0, "step": 1, "values": {"loss": 1.0}})):
        url = f"{world.address}{API}/jobs/{world.job_a}/{kind}"
        posted = httpx.post(url, headers=node, timeout=10, json={"launch_id": own, "records": [record]})
        assert posted.status_code == 200, posted.text
        forged = httpx.post(url, headers=node, timeout=10, json={"launch_id": other, "records": [record]})
        assert forged.status_code == 403 and other in forged.json()["detail"], forged.text
