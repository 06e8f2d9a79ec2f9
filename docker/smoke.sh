#!/usr/bin/env bash
# make docker-smoke: build both images and probe each wherever a Docker engine runs.
# Each probe: the container turns healthy (its HEALTHCHECK on /ready), /ready answers on the
# published port, a completion comes back, the server runs as a non-root user, and SIGTERM
# drains to exit 0. The CUDA image runs only where Docker has GPUs; SMOKE_GPU=0 only builds it.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE_GPU=${SMOKE_GPU:-auto}
PY=${PY:-python3}

docker info >/dev/null 2>&1 || { echo "docker-smoke: no Docker engine answers (docker info failed)" >&2; exit 1; }

if docker compose version >/dev/null 2>&1; then
  # the profiles: the CPU service by default, the CUDA service alone under --profile gpu
  test "$(docker compose config --services)" = "s5serve"
  test "$(docker compose --profile gpu config --services)" = "s5serve-cuda"
fi

probe() {  # probe IMAGE [docker run options...]
  local image=$1; shift
  local name="s5serve-smoke-$$-${image//[:\/]/-}"
  docker run -d --name "$name" -p 127.0.0.1::8000 "$@" "$image" >/dev/null
  trap 'docker rm -f "$name" >/dev/null 2>&1 || true' RETURN
  local port status=starting
  port=$(docker port "$name" 8000/tcp | head -n1 | sed 's/.*://')
  for _ in $(seq 1 180); do
    status=$(docker inspect -f '{{.State.Health.Status}}' "$name")
    [ "$status" = healthy ] && break
    [ "$(docker inspect -f '{{.State.Running}}' "$name")" = true ] || break
    sleep 2
  done
  if [ "$status" != healthy ]; then
    docker logs "$name" | tail -n 40 >&2
    echo "docker-smoke: $image never turned healthy ($status)" >&2
    return 1
  fi
  "$PY" - "$port" <<'PYEOF'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
assert urllib.request.urlopen(base + "/ready", timeout=10).status == 200
body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
text = reply["choices"][0]["text"]
assert text.strip(), reply
print(f"  completion: {text!r}")
PYEOF
  local uid
  uid=$(docker exec "$name" id -u)
  [ "$uid" != 0 ] || { echo "docker-smoke: $image runs as root" >&2; return 1; }
  docker exec "$name" s5serve --help >/dev/null
  docker stop -t 40 "$name" >/dev/null
  local code
  code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
  [ "$code" = 0 ] || { echo "docker-smoke: $image exited $code on SIGTERM" >&2; return 1; }
  echo "docker-smoke: $image ok (uid $uid, healthy, completion, drained)"
}

docker build -f docker/Dockerfile -t s5serve:cpu .
probe s5serve:cpu

docker build -f docker/Dockerfile.cuda -t s5serve:cuda .
if [ "$SMOKE_GPU" = 0 ]; then
  echo "docker-smoke: s5serve:cuda built, not run (SMOKE_GPU=0)"
elif docker run --rm --gpus all s5serve:cuda python -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  probe s5serve:cuda --gpus all
elif [ "$SMOKE_GPU" = 1 ]; then
  echo "docker-smoke: SMOKE_GPU=1 but Docker sees no GPU" >&2; exit 1
else
  echo "docker-smoke: s5serve:cuda built; no GPU visible to Docker, not run"
fi
