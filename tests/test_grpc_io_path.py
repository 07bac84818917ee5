"""What importing `services` sets before gRPC loads: gRPC's older I/O path and a short backup poll
(`services/__init__.py`), unless the user chose their own values; and a process that then uses gRPC
runs with them. (That a long-lived channel sees a server soon after it listens is
tests/engine/test_engine_server.py's NOT_SERVING-while-loading test: it fails at the 5 s default poll.)"""

import os
import subprocess
import sys

import services

PROBE = ("import services, os, grpc; grpc.insecure_channel('127.0.0.1:1').close(); "
         "print(os.environ['GRPC_EXPERIMENTS'], os.environ['GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS'])")


def run_probe(env_changes: dict[str, str]) -> subprocess.CompletedProcess:
    ours = ("GRPC_EXPERIMENTS", "GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS")
    env = {k: v for k, v in os.environ.items() if k not in ours} | env_changes
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True)


def test_a_service_process_takes_grpcs_older_io_path_and_grpc_knows_the_experiments():
    probe = run_probe({})
    assert probe.stdout.split() == [services.GRPC_EXPERIMENTS, services.GRPC_BACKUP_POLL_INTERVAL_MS]
    assert "Unknown experiment" not in probe.stderr  # grpcio dropped one: the setting would do nothing


def test_the_users_own_values_are_left_as_they_are():
    probe = run_probe({"GRPC_EXPERIMENTS": "event_engine_client", "GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS": "5000"})
    assert probe.stdout.split() == ["event_engine_client", "5000"]
