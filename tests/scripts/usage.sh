# Sourced first by the check scripts here, before they change directory:
#   usage_check "SYNOPSIS" MIN MAX [FLAG...] -- "$@"
# -h or --help prints the script's header comment, then SYNOPSIS (exit 0); an option not among the
# FLAGs, or fewer than MIN or more than MAX other arguments, is a usage error: SYNOPSIS on stderr, exit 2.
#   usage_path PATH   PATH made absolute from the directory the script was started in (a script that
#                     then changes directory would read a relative BUILD_DIR from the wrong place).
usage_here=$PWD
usage_check() {
  local synopsis=$1 min=$2 max=$3 flags=" " a n=0
  shift 3
  while (($#)) && [[ $1 != -- ]]; do flags+="$1 "; shift; done
  (($#)) && shift
  for a in "$@"; do
    case $a in
      -h|--help) sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; echo "usage: $synopsis"; exit 0 ;;
      -*) [[ $flags == *" $a "* ]] || { echo "$(basename "$0"): unknown option '$a'; usage: $synopsis" >&2; exit 2; } ;;
      *) n=$((n + 1)) ;;
    esac
  done
  ((n >= min && n <= max)) || { echo "$(basename "$0"): $n argument(s); usage: $synopsis" >&2; exit 2; }
}
usage_path() { [[ $1 == /* ]] && echo "$1" || echo "$usage_here/$1"; }
