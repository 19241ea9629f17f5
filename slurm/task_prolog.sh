#!/bin/sh
# TaskProlog of the local cluster: lines "export NAME=VALUE" become the task's environment.
# Emulated nodes share one host, where Open MPI's shared-memory transport crashes
# between "nodes": keep MPI on TCP.
echo "export OMPI_MCA_btl=self,tcp"
