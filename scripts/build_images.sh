#!/usr/bin/env bash
# Build the MineDraft images (needs a Docker engine with BuildKit), from anywhere in the repository:
#
#   scripts/build_images.sh                        # minedraft-cuda:<version> and minedraft-cpu:<version>
#   REGISTRY=registry.example.com/ml scripts/build_images.sh --push    # prefixed, then pushed
#   scripts/build_images.sh --kind minedraft       # minedraft-cpu only, loaded into the kind cluster "minedraft"
#
# <version> is the package version (services/minedraft/version.py, the chart's appVersion); TAG=... overrides
# it. .github/workflows/images.yml runs this with --push on every version tag.
# minedraft-cuda serves the drafter and verifier on GPUs (docker/Dockerfile.cuda); minedraft-cpu serves the
# scheduler, and everything in the chart's cpu profile (docker/Dockerfile.cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

push=false
kind_cluster=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --push) push=true; shift ;;
    --kind) kind_cluster="${2:?--kind needs the cluster name}"; shift 2 ;;
    *) echo "usage: $0 [--push] [--kind CLUSTER]" >&2; exit 2 ;;
  esac
done

version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' services/minedraft/version.py)
tag="${TAG:-$version}"
prefix="${REGISTRY:+$REGISTRY/}"

images=(cpu)
[[ -z "$kind_cluster" ]] && images=(cuda cpu)
for flavour in "${images[@]}"; do
  ref="${prefix}minedraft-${flavour}:${tag}"
  echo "building $ref from docker/Dockerfile.${flavour}"
  DOCKER_BUILDKIT=1 docker build -f "docker/Dockerfile.${flavour}" -t "$ref" .
  if $push; then docker push "$ref"; fi
  if [[ -n "$kind_cluster" ]]; then kind load docker-image "$ref" --name "$kind_cluster"; fi
done
