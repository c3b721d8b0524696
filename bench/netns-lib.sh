# Sourced by the bench scripts that need a real kernel path: two network namespaces joined
# by a veth pair, removed when the script exits.
#
# veth_pair TAG NET: namespaces A=TAG-aPID and B=TAG-bPID, veth ends DA (in A, NET.1/24)
# and DB (in B, NET.2/24), every link up. TAG's first two letters name the veth ends
# (interface names are at most 15 characters).
veth_pair() {
  local tag=$1 net=$2
  A=$tag-a$$ B=$tag-b$$ DA=${tag:0:2}a$$ DB=${tag:0:2}b$$
  trap 'ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true' EXIT
  ip netns add "$A"; ip netns add "$B"
  ip link add "$DA" type veth peer name "$DB"
  ip link set "$DA" netns "$A"; ip link set "$DB" netns "$B"
  ip -n "$A" addr add "$net.1/24" dev "$DA"; ip -n "$B" addr add "$net.2/24" dev "$DB"
  for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
  ip -n "$A" link set "$DA" up; ip -n "$B" link set "$DB" up
}
