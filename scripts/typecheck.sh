#!/usr/bin/env bash
# Type-check the package with mypy ([tool.mypy] in pyproject.toml); `make typecheck`, part of `make test`.
# callbacks/ and kernels/ are installed as spectrain.callbacks and spectrain.kernels ([tool.setuptools.package-dir]),
# a mapping that mypy cannot read from the editable install: links under build/typecheck/spectrain/ (on mypy_path)
# give mypy the same layout. Its messages name the files by their paths in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
LINKS=build/typecheck/spectrain
mkdir -p "$LINKS"
for pkg in callbacks kernels; do
  ln -sfn "../../../$pkg" "$LINKS/$pkg"
done
.venv/bin/mypy "$@" | sed "s#^$LINKS/##"
