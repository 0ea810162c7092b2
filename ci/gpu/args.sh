# shellcheck shell=bash
# What every GPU-host script checks before it acts, sourced first with the script's usage
# line as its one argument (`. "$here/args.sh" "usage: ..."`):
# its arguments against its usage line, and every number it reads from the environment or
# its arguments as plain digits. No value is ever evaluated by the shell: bash arithmetic
# runs the command substitutions in a value's array subscripts (TIME_LIMIT='x[$(cmd)]'),
# so a value is matched against a pattern before any arithmetic sees it.

usage=$1

# An unknown or missing argument: one line naming it, with the script's usage, exit 2.
usage_error() {  # WHY
  echo "error: ${0##*/}: $1 ($usage)" >&2
  exit 2
}

# A bad setting: one line naming it, exit 2.
refuse() {  # WHY
  echo "error: ${0##*/}: $1" >&2
  exit 2
}

# NAME VALUE: VALUE is a whole number of at most 9 digits (no sign, no expression, no
# leading zero, which bash would read as octal), so no arithmetic on it overflows or runs
# anything.
whole_number() {
  [[ $2 =~ ^(0|[1-9][0-9]{0,8})$ ]] ||
    refuse "$1 must be a whole number (at most 9 digits), not '$2'"
}

# NAME WHAT: the variable NAME is set and not empty; WHAT says what it names.
required() {
  [ -n "${!1:-}" ] || refuse "$1 is not set: $2"
}

# PATH: PATH made absolute against the folder the script was started in, before the script
# changes folder (a relative argument means the caller's folder, not the repository's).
absolute() {
  case $1 in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$PWD/$1" ;;
  esac
}

# COMMAND...: run it in the background and wait for it, so that a signal to this script
# reaches it too (bash runs a trap only once a child in the foreground has ended, and an
# untrapped signal ends the script but leaves the child running).
stoppable() {
  "$@" &
  child=$!
  wait "$child"
}

# SIGTERM, SIGHUP and SIGINT stop the child `stoppable` runs (which cleans up after itself)
# and then the script, with 128 + the signal's number; its EXIT trap runs then.
stop_child() {  # CODE
  trap - TERM HUP INT
  if [ -n "${child:-}" ]; then
    kill -TERM "$child" 2> /dev/null
    wait "$child"
  fi
  exit "$1"
}
stop_on_signals() {
  trap 'stop_child 143' TERM
  trap 'stop_child 129' HUP
  trap 'stop_child 130' INT
}
