/*
 * An MPI program built against the MPICH-ABI stand-in (tests only). Prints each
 * call's return code and results, one line each, so that a run under the hook can
 * be compared line by line with a run without it.
 */
#include <stdio.h>

#include "mpi.h"

int main(int argc, char **argv)
{
	int size = -1, rank = -1, in[3] = { 1, 2, 3 }, out[3] = { 0, 0, 0 }, got = -1;
	int one = 42, ring = -1, rc, rc2, rc3;
	double d[2] = { 0.5, 1.5 };
	MPI_Status st = { -7, -7, -7, -7, -7 };
	MPI_Request req[2];
	MPI_Comm dup = MPI_COMM_NULL;

	rc = MPI_Init(&argc, &argv);
	printf("init %d\n", rc);
	rc = MPI_Comm_size(MPI_COMM_WORLD, &size);
	rc2 = MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	printf("size %d %d rank %d %d\n", rc, size, rc2, rank);
	/* MPI_PROC_NULL is -1 here, Open MPI's MPI_ANY_SOURCE; MPI_STATUS_IGNORE is 1. */
	rc = MPI_Recv(&got, 1, MPI_INT, MPI_PROC_NULL, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	printf("recv proc_null ignore %d got %d\n", rc, got);
	rc = MPI_Recv(&got, 1, MPI_INT, MPI_PROC_NULL, 0, MPI_COMM_WORLD, &st);
	printf("recv proc_null status %d source %d tag %d\n", rc, st.MPI_SOURCE, st.MPI_TAG);
	rc = MPI_Send(&one, 1, MPI_INT, MPI_PROC_NULL, 1, MPI_COMM_WORLD);
	printf("send proc_null %d\n", rc);
	rc = MPI_Send(&one, 1, MPI_INT, 0, 9, MPI_COMM_WORLD);
	printf("send self %d\n", rc);
	rc = MPI_Recv(&got, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
	printf("recv any_source %d got %d source %d tag %d\n", rc, got, st.MPI_SOURCE, st.MPI_TAG);
	rc = MPI_Allreduce(in, out, 3, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
	printf("allreduce %d %d %d %d\n", rc, out[0], out[1], out[2]);
	rc = MPI_Allreduce(MPI_IN_PLACE, d, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
	printf("allreduce in_place %d %.1f %.1f\n", rc, d[0], d[1]);
	rc = MPI_Irecv(&ring, 1, MPI_INT, 0, 3, MPI_COMM_WORLD, &req[0]);
	rc2 = MPI_Isend(&rank, 1, MPI_INT, 0, 3, MPI_COMM_WORLD, &req[1]);
	rc3 = MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
	printf("irecv %d isend %d waitall %d got %d\n", rc, rc2, rc3, ring);
	rc = MPI_Bcast(in, 3, MPI_INT, 0, MPI_COMM_WORLD);
	printf("bcast %d\n", rc);
	rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
	rc2 = MPI_Allreduce(in, out, 1, MPI_INT, MPI_SUM, dup);
	rc3 = MPI_Comm_free(&dup);
	printf("dup %d allreduce %d free %d\n", rc, rc2, rc3);
	rc = MPI_Barrier(MPI_COMM_WORLD);
	printf("barrier %d\n", rc);
	rc = MPI_Finalize();
	printf("finalize %d\n", rc);
	return 0;
}
