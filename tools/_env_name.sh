# Sourced by setup_env.sh and run_tests.sh: which dependency set (MM_DEPS) and which environment (VENV).
MM_DEPS="${MM_DEPS:-pinned}"
case "$MM_DEPS" in
  pinned) VENV="${MM_VENV:-.venv}" ;;
  latest) VENV="${MM_VENV:-.venv-latest}" ;;
  *) echo "MM_DEPS=$MM_DEPS: expected pinned (constraints.txt, the default) or latest" >&2; exit 2 ;;
esac
