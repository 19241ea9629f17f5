/*
 * MPI from C, linked to libmpi (MPI_COMM_WORLD is then a copy-relocated data
 * symbol in the executable): Allreduce on the world and on a duplicate,
 * Isend/Irecv/Waitall around the ring, Barrier. Prints "<rank> <sum> <recv>".
 */
#include <mpi.h>
#include <stdio.h>

int main(int argc, char **argv)
{
	int rank, size, in, out = 0, dup_out = 0, got = -1;
	MPI_Comm dup;
	MPI_Request req[2];

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	in = rank + 1;
	MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
	MPI_Comm_dup(MPI_COMM_WORLD, &dup);
	MPI_Allreduce(&in, &dup_out, 1, MPI_INT, MPI_MAX, dup);
	MPI_Irecv(&got, 1, MPI_INT, (rank + size - 1) % size, 5, MPI_COMM_WORLD, &req[0]);
	MPI_Isend(&rank, 1, MPI_INT, (rank + 1) % size, 5, MPI_COMM_WORLD, &req[1]);
	MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
	MPI_Barrier(MPI_COMM_WORLD);
	MPI_Comm_free(&dup);
	printf("%d %d %d %d\n", rank, out, dup_out, got);
	MPI_Finalize();
	return 0;
}
