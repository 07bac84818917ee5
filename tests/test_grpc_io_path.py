"""What importing `services` sets before gRPC loads: gRPC's older I/O path (`services/__init__.py`),
unless the user chose their own experiments; and a process that then uses gRPC runs with it."""

import os
import subprocess
import sys

import services

PROBE = "import services, os, grpc; grpc.insecure_channel('127.0.0.1:1').close(); print(os.environ['GRPC_EXPERIMENTS'])"


def run_probe(env_changes: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | env_changes
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True)


def test_a_service_process_takes_grpcs_older_io_path_and_grpc_knows_the_experiments():
    probe = run_probe({})
    assert probe.stdout.strip() == services.GRPC_EXPERIMENTS
    assert "Unknown experiment" not in probe.stderr  # grpcio dropped one: the setting would do nothing


def test_the_users_own_experiments_are_left_as_they_are():
    assert run_probe({"GRPC_EXPERIMENTS": "event_engine_client"}).stdout.strip() == "event_engine_client"
