/*
 * The part of MPICH's mpi.h that tests/mpich_standin/ needs (tests only).
 *
 * The values are MPICH's (also those of Intel MPI, MVAPICH and Cray MPICH, which
 * share its ABI): handles are ints, MPI_COMM_WORLD is 0x44000000, MPI_PROC_NULL
 * is -1, MPI_ANY_SOURCE -2, MPI_STATUS_IGNORE is (MPI_Status *)1 and
 * MPI_IN_PLACE (void *)-1. An LD_PRELOAD library compiled against Open MPI's
 * mpi.h reads the same bits with other meanings.
 */
#ifndef MPI_INCLUDED
#define MPI_INCLUDED

#define MPICH 1
#define MPICH_NUMVERSION 40100300

typedef int MPI_Comm;
typedef int MPI_Datatype;
typedef int MPI_Op;
typedef int MPI_Group;
typedef int MPI_Request;

typedef struct MPI_Status {
	int count_lo;
	int count_hi_and_cancelled;
	int MPI_SOURCE;
	int MPI_TAG;
	int MPI_ERROR;
} MPI_Status;

#define MPI_COMM_WORLD ((MPI_Comm)0x44000000)
#define MPI_COMM_SELF ((MPI_Comm)0x44000001)
#define MPI_COMM_NULL ((MPI_Comm)0x04000000)
#define MPI_GROUP_EMPTY ((MPI_Group)0x48000000)
#define MPI_INT ((MPI_Datatype)0x4c000405)
#define MPI_DOUBLE ((MPI_Datatype)0x4c00080b)
#define MPI_SUM ((MPI_Op)0x58000003)
#define MPI_MAX ((MPI_Op)0x58000001)
#define MPI_REQUEST_NULL ((MPI_Request)0x2c000000)

#define MPI_SUCCESS 0
#define MPI_ERR_COMM 5
#define MPI_ERR_TYPE 3
#define MPI_ERR_RANK 6
#define MPI_ERR_INTERN 16
#define MPI_PROC_NULL (-1)
#define MPI_ANY_SOURCE (-2)
#define MPI_ROOT (-3)
#define MPI_ANY_TAG (-1)
#define MPI_UNDEFINED (-32766)
#define MPI_COMBINER_NAMED 1
#define MPI_MAX_LIBRARY_VERSION_STRING 8192
#define MPI_STATUS_IGNORE ((MPI_Status *)1)
#define MPI_STATUSES_IGNORE ((MPI_Status *)1)
#define MPI_IN_PLACE ((void *)-1)

int MPI_Init(int *argc, char ***argv);
int MPI_Finalize(void);
int MPI_Get_library_version(char *version, int *resultlen);
int MPI_Comm_size(MPI_Comm comm, int *size);
int MPI_Comm_rank(MPI_Comm comm, int *rank);
int MPI_Comm_dup(MPI_Comm comm, MPI_Comm *newcomm);
int MPI_Comm_free(MPI_Comm *comm);
int MPI_Comm_group(MPI_Comm comm, MPI_Group *group);
int MPI_Group_translate_ranks(MPI_Group group1, int n, const int ranks1[], MPI_Group group2,
			      int ranks2[]);
int MPI_Group_free(MPI_Group *group);
int MPI_Type_size(MPI_Datatype datatype, int *size);
int MPI_Type_get_envelope(MPI_Datatype datatype, int *num_integers, int *num_addresses,
			  int *num_datatypes, int *combiner);
int MPI_Send(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
	     MPI_Comm comm);
int MPI_Recv(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm,
	     MPI_Status *status);
int MPI_Isend(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
	      MPI_Comm comm, MPI_Request *request);
int MPI_Irecv(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm,
	      MPI_Request *request);
int MPI_Wait(MPI_Request *request, MPI_Status *status);
int MPI_Waitall(int count, MPI_Request requests[], MPI_Status *statuses);
int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
		  MPI_Op op, MPI_Comm comm);
int MPI_Bcast(void *buffer, int count, MPI_Datatype datatype, int root, MPI_Comm comm);
int MPI_Barrier(MPI_Comm comm);

#endif
