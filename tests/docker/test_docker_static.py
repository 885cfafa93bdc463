"""Static checks of the Docker deployment: schema, lint and invariants. No engine needed."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys

import pytest

from docker_helpers import COMPOSE_FILE, DOCKERFILES, ROOT, STACK_FILE, run, skip_or_fail, tool
from ddiloco.wan.profiles import load_profiles

try:
    import yaml
except ImportError:  # a test dependency; skip_or_fail below says so
    yaml = None

SHAPING_ENV = "DDILOCO_WAN_PROFILE"


def load(path):
    if yaml is None:
        skip_or_fail("pyyaml is not installed (pip install '.[test]')")
    # PyYAML resolves the anchors and << merge keys, as Compose does.
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def compose():
    return load(COMPOSE_FILE)


@pytest.fixture(scope="module")
def stack():
    return load(STACK_FILE)


def env_of(svc: dict) -> dict:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


# -- schema and lint ------------------------------------------------------------------------

@pytest.mark.parametrize("path", [COMPOSE_FILE, STACK_FILE], ids=lambda p: p.name)
def test_validates_against_the_compose_spec_schema(path):
    # check-jsonschema bundles the Compose specification's schema: this runs offline.
    run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    # Any ignored rule carries a `# hadolint ignore=` comment with its reason in the file.
    run(tool("hadolint"), str(dockerfile))


def test_every_hadolint_ignore_is_justified():
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                rules = line.split("ignore=")[1].split(",")
                context = "\n".join(lines[max(0, i - 4):i])
                for rule in rules:
                    assert rule.strip() in context, f"{dockerfile.name}:{i + 1}: {rule} ignored without a reason above it"


def test_compose_config_resolves(engine):
    # Semantic checks beyond the schema, by Compose itself: anchors and merge keys,
    # interpolation, profiles, depends_on targets. (The engine fixture installs the plugin.)
    for profile in ("lan", "wan", "wan-slow", "wan-mixed"):
        out = run("docker", "compose", "-f", str(COMPOSE_FILE), "--profile", profile, "config", "--services").stdout
        assert set(out.split()) == {"certs", "coordinator", "outer", learner_service(profile)}
    # no --profile: .env selects lan
    out = run("docker", "compose", "-f", str(COMPOSE_FILE), "config", "--services", env={"COMPOSE_PROFILES": None}).stdout
    assert "learner" in out.split()


def learner_service(profile: str) -> str:
    return "learner" + ("" if profile == "lan" else f"-{profile}")


def compose_plugin() -> None:
    """`docker compose config` renders the file without an engine; skip (fail in CI) if the
    plugin is missing."""
    try:
        ok = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        skip_or_fail("the docker compose plugin is not installed (docker/engine.sh installs it)")


@pytest.mark.parametrize("learners", [None, "2", "7"])
@pytest.mark.parametrize("profile", ["lan", "wan", "wan-slow", "wan-mixed"])
def test_compose_starts_exactly_ddiloco_learners_learners(profile, learners):
    """`DDILOCO_LEARNERS=N docker compose up` starts N learner containers (the replicas of the
    profile's one learner service) and plans the run for N: Compose renders the file."""
    compose_plugin()
    env = {"DDILOCO_LEARNERS": learners, "COMPOSE_PROFILES": None}
    rendered = json.loads(run("docker", "compose", "-f", str(COMPOSE_FILE), "--profile", profile, "config", "--format",
                              "json", env=env).stdout)
    n = int(learners or 4)
    learner_services = {name: svc for name, svc in rendered["services"].items() if svc.get("command") == ["learner"]}
    assert list(learner_services) == [learner_service(profile)], "one learner service per profile"
    svc = learner_services[learner_service(profile)]
    assert svc["deploy"]["replicas"] == n and svc.get("scale", n) == n
    assert f"--learners={n}" in rendered["services"]["coordinator"]["command"]


@pytest.mark.parametrize("shards", [None, "3"])
def test_compose_starts_one_outer_replica_per_outer_shard(shards):
    """`DDILOCO_OUTER_SHARDS=S docker compose up` plans the run for S outer shards and starts
    S outer replicas, each of which takes its shard from its replica number and advertises
    its own address (entrypoint); one replica keeps the service's name."""
    compose_plugin()
    env = {"DDILOCO_OUTER_SHARDS": shards, "COMPOSE_PROFILES": None}
    rendered = json.loads(run("docker", "compose", "-f", str(COMPOSE_FILE), "config", "--format", "json", env=env).stdout)
    n = int(shards or 1)
    outer = rendered["services"]["outer"]
    assert outer["deploy"]["replicas"] == n
    assert outer["environment"]["DDILOCO_OUTER_SHARDS"] == str(n)
    assert outer["environment"]["DDILOCO_SHARD_FROM"] == "replica"
    assert outer["environment"]["DDILOCO_ADVERTISE"] == "outer:50052"
    assert "--advertise" not in " ".join(outer["command"])  # a flag would beat the entrypoint's address
    assert rendered["services"]["coordinator"]["environment"]["DDILOCO_OUTER_SHARDS"] == str(n)


def test_compose_passes_a_learners_ranks_and_the_workload_through_from_the_shell():
    """`DDILOCO_RANKS_PER_LEARNER=2 DDILOCO_WORKLOAD=... docker compose up` runs each learner
    as a group of 2 ranks and the run on the user's workload: Compose hands the variables to
    the coordinator that plans the run (the learners follow its configuration; a learner's own
    DDILOCO_NPROC_PER_LEARNER still reaches it); unset, they stay out of the containers and
    the commands' defaults hold."""
    compose_plugin()
    from ddiloco.common.cliargs import env_name

    assert env_name("--nproc-per-learner", "DDILOCO_") == "DDILOCO_NPROC_PER_LEARNER"
    assert env_name("--ranks-per-learner", "DDILOCO_") == "DDILOCO_RANKS_PER_LEARNER"
    assert env_name("--workload-arg", "DDILOCO_") == "DDILOCO_WORKLOAD_ARG"
    shell = {"DDILOCO_RANKS_PER_LEARNER": "2", "DDILOCO_NPROC_PER_LEARNER": "3", "DDILOCO_WORKLOAD": "examples.mlp_regression:workload",
             "DDILOCO_WORKLOAD_ARG": "width=32 'note=two words'", "COMPOSE_PROFILES": None}
    for profile in ("lan", "wan-mixed"):
        rendered = json.loads(run("docker", "compose", "-f", str(COMPOSE_FILE), "--profile", profile, "config", "--format",
                                  "json", env=shell).stdout)["services"]
        assert env_of(rendered[learner_service(profile)])["DDILOCO_NPROC_PER_LEARNER"] == "3"
        coordinator = env_of(rendered["coordinator"])
        assert coordinator["DDILOCO_RANKS_PER_LEARNER"] == "2"
        assert coordinator["DDILOCO_WORKLOAD"] == "examples.mlp_regression:workload"
        assert coordinator["DDILOCO_WORKLOAD_ARG"] == "width=32 'note=two words'"
    unset = {key: None for key in shell}
    rendered = json.loads(run("docker", "compose", "-f", str(COMPOSE_FILE), "config", "--format", "json",
                              env=unset).stdout)["services"]
    assert env_of(rendered["learner"]).get("DDILOCO_NPROC_PER_LEARNER") in (None, "")
    assert env_of(rendered["coordinator"]).get("DDILOCO_WORKLOAD") in (None, "")
    assert env_of(rendered["coordinator"]).get("DDILOCO_RANKS_PER_LEARNER") in (None, "")


def test_stack_config_resolves(engine):
    if run("docker", "stack", "config", "--help", check=False).returncode != 0:
        pytest.skip("this docker CLI has no `docker stack config` (added after 20.10); the Swarm e2e test deploys the file")
    out = run("docker", "stack", "config", "-c", str(STACK_FILE), env={"DDILOCO_LEARNERS": "3"}).stdout
    assert "replicas: 3" in out


# -- invariants -----------------------------------------------------------------------------

def test_every_service_healthy_target_has_a_healthcheck(compose):
    services = compose["services"]
    targets = 0
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if cond.get("condition") == "service_healthy":
                targets += 1
                hc = services[dep].get("healthcheck")
                assert hc and not hc.get("disable"), f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck"
                assert hc["test"][:3] == ["CMD", "ddiloco", "health"], f"{dep}'s healthcheck is not `ddiloco health`"
    assert targets >= 2  # outer waits for the coordinator, learners for the outer


def test_every_long_running_service_has_a_grpc_healthcheck(compose, stack):
    for doc in (compose, stack):
        for name, svc in doc["services"].items():
            if svc.get("command", [""])[0] in ("coordinator", "outer", "learner"):
                port = {"coordinator": "50051", "outer": "50052", "learner": "50060"}[svc["command"][0]]
                assert svc["healthcheck"]["test"] == ["CMD", "ddiloco", "health", f"127.0.0.1:{port}"], name


def test_every_shaping_service_has_net_admin_and_starts_as_root(compose, stack):
    shaping = 0
    for doc in (compose, stack):
        for name, svc in doc["services"].items():
            if SHAPING_ENV in env_of(svc):
                shaping += 1
                assert "NET_ADMIN" in (svc.get("cap_add") or []), f"{name} shapes traffic without NET_ADMIN"
                # the image's user is unprivileged; tc needs root, which the entrypoint then drops
                assert str(svc.get("user", "")).split(":")[0] in ("0", "root"), f"{name} cannot run tc as non-root"
            else:
                assert "NET_ADMIN" not in (svc.get("cap_add") or []), f"{name} has NET_ADMIN but shapes nothing"
    assert shaping >= 5


def test_every_profile_maps_to_a_defined_bandwidth_profile(compose):
    bandwidth = set(load_profiles())
    compose_profiles = {p for svc in compose["services"].values() for p in svc.get("profiles", [])}
    tools = {"tools", "monitoring"}  # one-shot helpers and the Prometheus server: not a bandwidth profile
    assert compose_profiles - tools <= bandwidth, f"compose profiles without a bandwidth profile: {compose_profiles - tools - bandwidth}"
    assert bandwidth <= compose_profiles, f"bandwidth profiles without compose learners: {bandwidth - compose_profiles}"
    for name, svc in compose["services"].items():
        env = env_of(svc)
        if SHAPING_ENV in env:
            assert svc.get("profiles") == [env[SHAPING_ENV]], f"{name}: profile {svc.get('profiles')} shapes as {env[SHAPING_ENV]}"


def test_each_profile_has_one_replicated_learner_service_with_its_own_links(compose):
    """Each learner replica is a datacenter: its index from its container name, its own link
    into the learners' network, which the coordinator and the outer optimizer are on; the
    replicas and the run's M come from the same variable with the same default."""
    default_learners = re.search(r"--learners=\$\{DDILOCO_LEARNERS:-(\d+)\}", " ".join(compose["services"]["coordinator"]["command"]))
    assert default_learners, "the coordinator's learner count must come from DDILOCO_LEARNERS"
    profiles = []
    for name, svc in compose["services"].items():
        env = env_of(svc)
        if SHAPING_ENV in env:
            profiles.append(env[SHAPING_ENV])
            assert svc["deploy"]["replicas"] == f"${{DDILOCO_LEARNERS:-{default_learners.group(1)}}}", name
            assert env["DDILOCO_DATACENTER_FROM"] == "replica" and "DDILOCO_DATACENTER" not in env, name
            assert len(svc["networks"]) == 1, f"{name}: one link per container"
            for hub in ("coordinator", "outer"):
                assert svc["networks"][0] in compose["services"][hub]["networks"], f"{hub} cannot reach {name}"
    assert sorted(profiles) == sorted(set(profiles)), "one learner service per profile"


def test_plain_up_selects_the_lan_profile():
    # `docker compose up` without --profile reads COMPOSE_PROFILES from .env
    env = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "lan"


@pytest.mark.parametrize("path", [COMPOSE_FILE, STACK_FILE], ids=lambda p: p.name)
def test_every_network_has_an_explicit_subnet(path):
    doc = load(path)
    assert doc.get("networks"), "no networks: services would land on an automatic subnet"
    for name, net in doc["networks"].items():
        configs = (net or {}).get("ipam", {}).get("config", [])
        assert configs, f"network {name} has no explicit subnet"
        for cfg in configs:
            subnet = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", cfg["subnet"])  # the default
            ipaddress.ip_network(subnet)
    for name, svc in doc["services"].items():
        # no service may fall back to Compose's implicit default network
        assert svc.get("networks") or svc.get("network_mode") == "none", f"{name} would join the default network"


def test_run_output_lives_in_a_named_volume(compose, stack):
    for doc in (compose, stack):
        assert "run" in doc["volumes"]
        for name, svc in doc["services"].items():
            if svc.get("profiles") == ["monitoring"]:
                continue  # Prometheus keeps its own time series, not the run's output
            assert "run:/data/run" in svc.get("volumes", []), name


def test_stack_waits_where_swarm_ignores_depends_on(stack):
    svcs = stack["services"]
    assert env_of(svcs["outer"])["DDILOCO_WAIT_FOR"] == "coordinator:50051"
    assert env_of(svcs["learner"])["DDILOCO_WAIT_FOR"] == "outer:50052"
    assert env_of(svcs["learner"])["DDILOCO_TASK_SLOT"] == "{{.Task.Slot}}"


def test_prometheus_scrapes_every_service_of_every_profile_on_its_metrics_port(compose):
    config = load(ROOT / "docker" / "prometheus.yml")
    scraped = {n for sd in config["scrape_configs"][0]["dns_sd_configs"] for n in sd["names"]}
    assert {sd["port"] for sd in config["scrape_configs"][0]["dns_sd_configs"]} == {9100}
    served = set()
    for name, svc in compose["services"].items():
        if svc.get("command", [""])[0] in ("coordinator", "outer", "learner"):
            served.add(name)
            assert env_of(svc).get("DDILOCO_METRICS_PORT") == "9100", f"{name} serves no /metrics on 9100"
    assert served == scraped, f"served but not scraped: {served - scraped}; scraped but no such service: {scraped - served}"
    prom = compose["services"]["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    # every datacenter network: learners are reachable only on their own
    assert set(prom["networks"]) == set(compose["services"]["coordinator"]["networks"])


def test_dockerignore_keeps_the_context_small():
    lines = (ROOT / ".dockerignore").read_text().split()
    assert lines[0] == "**" or "**" in lines  # deny by default, then allow what the image needs
    for needed in ("!pyproject.toml", "!services/", "!docker/entrypoint.sh", "!docker/wheels/", "!docker/prometheus.yml"):
        assert needed in lines


# -- Kubernetes manifests (validated only: no cluster runs them here) ------------------------

K8S_FILE = ROOT / "docker" / "k8s" / "ddiloco.yaml"


def k8s_docs() -> list[dict]:
    if yaml is None:
        skip_or_fail("pyyaml is not installed (pip install '.[test]')")
    with open(K8S_FILE, encoding="utf-8") as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def test_k8s_manifests_validate_against_the_kubernetes_schemas():
    # kubernetes-validate bundles the schemas (offline) but is ~100 MB, so it is optional
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed; K8s schema check skipped")
    run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", "1.33.0", str(K8S_FILE))


def test_k8s_invariants():
    docs = k8s_docs()
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}
    services = [d for d in docs if d["kind"] == "Service"]
    assert set(jobs) == {"ddiloco-coordinator", "ddiloco-outer", "ddiloco-learners"}
    for svc in services:  # every Service selects the pods of some Job
        sel = svc["spec"]["selector"].items()
        assert any(sel <= j["spec"]["template"]["metadata"]["labels"].items() for j in jobs.values()), svc["metadata"]["name"]
    for name, job in jobs.items():
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert c["readinessProbe"]["exec"]["command"][:2] == ["ddiloco", "health"], name
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        caps = c.get("securityContext", {}).get("capabilities", {})
        if SHAPING_ENV in env:
            assert env[SHAPING_ENV] in load_profiles()
            assert "NET_ADMIN" in caps.get("add", []) and c["securityContext"]["runAsUser"] == 0, name
            assert {"SETUID", "SETGID", "SETPCAP"} <= set(caps["add"]), f"{name}: the entrypoint cannot drop privileges"
        else:
            assert caps.get("drop") == ["ALL"] and not caps.get("add"), name
    learners = jobs["ddiloco-learners"]["spec"]
    coordinator_args = jobs["ddiloco-coordinator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert learners["completionMode"] == "Indexed"
    assert f"--learners={learners['completions']}" in coordinator_args
    # one pod per outer shard, pod I shard I (JOB_COMPLETION_INDEX), as many as the run plans
    outer = jobs["ddiloco-outer"]["spec"]
    (oc,) = outer["template"]["spec"]["containers"]
    outer_env = {e["name"]: e.get("value") for e in oc["env"]}
    assert outer["completionMode"] == "Indexed"
    assert outer["completions"] == outer["parallelism"] == int(outer_env["DDILOCO_OUTER_SHARDS"])
    assert f"--outer-shards={outer['completions']}" in coordinator_args
    assert not any(a.startswith("--advertise") for a in oc["args"])  # a flag would beat a shard's own address
    assert outer_env["DDILOCO_ADVERTISE"] == "outer:50052"


# -- mutual TLS (docs/security.md) -----------------------------------------------------------

SERVING = ("coordinator", "outer", "learner")


def test_compose_issues_certificates_before_any_service_starts(compose):
    """A one-shot `certs` service fills the certs volume; every service waits for it to have
    succeeded and reads its identity from there (learners: their replica's, from the bundle)."""
    services = compose["services"]
    certs = services["certs"]
    assert certs["command"][:3] == ["certs", "setup", "/data/certs"]
    assert "--learners=${DDILOCO_LEARNERS:-4}" in certs["command"], "a certificate for every planned learner"
    assert certs.get("network_mode") == "none" and certs.get("restart") == "no"
    assert "certs" in compose["volumes"]
    served = 0
    for name, svc in services.items():
        if svc.get("command", [""])[0] not in SERVING:
            continue
        served += 1
        assert svc["depends_on"]["certs"] == {"condition": "service_completed_successfully"}, name
        assert "certs:/data/certs" in svc["volumes"], name
        env = env_of(svc)
        assert env["DDILOCO_TLS_DIR"], name
        if svc["command"][0] == "learner":
            assert env["DDILOCO_TLS_BUNDLE"] == "/data/certs/learners.json", name
        else:
            assert env["DDILOCO_TLS_DIR"] == f"/data/certs/{svc['command'][0]}", name
            assert env["DDILOCO_REVOKED"] == "/data/certs/revoked.txt", name
    assert served >= 6


def test_stack_gives_each_service_only_its_own_key_as_secrets(stack):
    svcs = stack["services"]
    for role in ("coordinator", "outer"):
        targets = {s["source"]: s["target"] for s in svcs[role]["secrets"]}
        assert targets == {"ca": "ca.crt", f"{role}_crt": "tls.crt", f"{role}_key": "tls.key", "revoked": "revoked.txt"}, role
        assert env_of(svcs[role])["DDILOCO_TLS_DIR"] == "/run/secrets"
        assert env_of(svcs[role])["DDILOCO_REVOKED"] == "/run/secrets/revoked.txt"
    assert [s["source"] for s in svcs["learner"]["secrets"]] == ["learners"]
    assert env_of(svcs["learner"])["DDILOCO_TLS_BUNDLE"] == "/run/secrets/learners.json"
    assert set(stack["secrets"]) == {"ca", "coordinator_crt", "coordinator_key", "outer_crt", "outer_key", "learners", "revoked"}


def test_k8s_pods_take_the_workload_and_the_ranks_from_their_environment():
    """As in Compose and the Swarm stack: the coordinator plans the run's workload and ranks
    per learner (every pod follows its configuration), a learner may override its group's
    size; the values are empty in the file, which the commands read as unset (their
    defaults), and each name is the flag's own environment variable."""
    from ddiloco.common.cliargs import env_name

    jobs = {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == "Job"}

    def env(job: str) -> dict:
        (c,) = jobs[job]["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in c["env"]}

    coordinator, learner = env("ddiloco-coordinator"), env("ddiloco-learners")
    for flag in ("--workload", "--workload-arg", "--ranks-per-learner"):
        assert coordinator[env_name(flag, "DDILOCO_")] == "", flag
    assert learner[env_name("--nproc-per-learner", "DDILOCO_")] == ""
    # and each command reads them (its --help names the variable of each flag)
    for name, keys in (("coordinator", ("DDILOCO_WORKLOAD", "DDILOCO_WORKLOAD_ARG", "DDILOCO_RANKS_PER_LEARNER")),
                       ("learner", ("DDILOCO_NPROC_PER_LEARNER",))):
        shown = run(sys.executable, "-m", "ddiloco", name, "--help", env={"PYTHONPATH": str(ROOT / "services")}).stdout
        words = " ".join(shown.split())
        for key in keys:
            assert f"env {key}]" in words, (name, key)


def test_k8s_pods_mount_their_identity_from_the_tls_secret():
    jobs = {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == "Job"}
    for name, job in jobs.items():
        spec = job["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["DDILOCO_TLS_DIR"], name
        tls = next(v for v in spec["volumes"] if v["name"] == "tls")
        assert tls["secret"]["secretName"] == "ddiloco-tls", name
        keys = {i["key"] for i in tls["secret"]["items"]}
        if name == "ddiloco-learners":
            assert keys == {"learners.json"} and env["DDILOCO_TLS_BUNDLE"].endswith("/learners.json")
        else:
            role = name.removeprefix("ddiloco-")
            assert keys == {"ca.crt", f"{role}.crt", f"{role}.key", "revoked.txt"}, name


def test_the_entrypoint_runs_the_certs_command_and_unbundles_a_learners_identity():
    text = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert re.search(r"\| certs\) role=\$1", text)
    assert 'ddiloco certs unbundle "$DDILOCO_TLS_BUNDLE" --name "learner-$index"' in text
