#!/bin/sh
# TaskProlog of the local cluster: lines "export NAME=VALUE" become the task's environment.
# Emulated nodes share one host, where Open MPI's shared-memory transport crashes
# between "nodes": keep MPI on TCP.
echo "export OMPI_MCA_btl=self,tcp"
# With `scripts/cluster up --netns` a node's traffic must leave through its own eth0:
# the host name resolves to 127.0.0.1, which is private to each namespace.
if ip -o -4 addr show dev eth0 2>/dev/null | grep -q 'inet '; then
    echo "export GLOO_SOCKET_IFNAME=eth0"
    echo "export OMPI_MCA_btl_tcp_if_include=eth0"
    echo "export OMPI_MCA_oob_tcp_if_include=eth0"
fi
