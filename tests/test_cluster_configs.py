"""The cluster files are valid for the tools that read them, and keep the dashboard local."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


def test_launcher_yaml_matches_rays_schema_and_binds_dashboard_locally():
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((CLUSTER / "aws-gpu.yaml").read_text())
    jsonschema.validate(config, schema)
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    gpu_workers = [n for n in config["available_node_types"].values()
                   if n.get("resources", {}).get("GPU")]
    assert gpu_workers and all(n["max_workers"] > n["min_workers"] for n in gpu_workers)
    assert any("pip install" in c and "mtbert-tune" in c for c in config["setup_commands"])


def test_kuberay_manifest_has_gpu_workers_and_no_public_service():
    docs = list(yaml.safe_load_all((CLUSTER / "kuberay-raycluster.yaml").read_text()))
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert head["serviceType"] == "ClusterIP"
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert not any(d["kind"] in ("Ingress", "Service") for d in docs)


def test_mlflow_compose_publishes_on_loopback_with_sql_and_object_store():
    compose = yaml.safe_load((CLUSTER / "mlflow" / "docker-compose.yaml").read_text())
    services = compose["services"]
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
    command = services["mlflow"]["command"]
    assert "--backend-store-uri postgresql://" in command and "--artifacts-destination s3://" in command
