/*
 * A stand-in libmpi.so with MPICH's ABI (tests only): one process is the whole
 * world. It exists so that the hook can be loaded into a program built against
 * an MPICH-family MPI on a machine that has only Open MPI. Each call is defined
 * as PMPI_x with a weak MPI_x alias, as MPICH does, so an interposer's
 * dlsym(RTLD_NEXT, "MPI_x") finds it. Messages a process sends to itself are
 * buffered (eager) and matched by the next receive.
 */
#include <stdio.h>
#include <string.h>

#include "mpi.h"

#define ALIAS(fn) __typeof__(P##fn) fn __attribute__((weak, alias("P" #fn)))

#define KIND(h) ((unsigned)(h) >> 24)
#define KIND_COMM 0x44u
#define KIND_COMM_DUP 0x84u
#define KIND_TYPE 0x4cu
#define GROUP_OF_ONE ((MPI_Group)0x88000001)
#define MAX_MESSAGES 8
#define MAX_REQUESTS 16

struct message {
	MPI_Comm comm;
	int tag;
	int bytes;
	char data[256];
};

static int initialised;
static unsigned num_dups;
static struct message queue[MAX_MESSAGES];
static int num_queued;
static struct {
	void *buf;
	int bytes, source, tag;
	MPI_Comm comm;
	int in_use;
} pending_recv[MAX_REQUESTS];

static int valid_comm(MPI_Comm comm)
{
	return KIND(comm) == KIND_COMM || KIND(comm) == KIND_COMM_DUP;
}

/* Builtin datatypes carry their size in bits 8-15 of the handle. */
static int type_size(MPI_Datatype type)
{
	return KIND(type) == KIND_TYPE ? (int)(((unsigned)type >> 8) & 0xff) : -1;
}

static void set_status(MPI_Status *status, int source, int tag, int bytes)
{
	if (status == MPI_STATUS_IGNORE)
		return;
	status->MPI_SOURCE = source;
	status->MPI_TAG = tag;
	status->MPI_ERROR = MPI_SUCCESS;
	status->count_lo = bytes;
	status->count_hi_and_cancelled = 0;
}

int PMPI_Init(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	initialised = 1;
	return MPI_SUCCESS;
}
ALIAS(MPI_Init);

int PMPI_Finalize(void)
{
	initialised = 0;
	return num_queued == 0 ? MPI_SUCCESS : MPI_ERR_INTERN;
}
ALIAS(MPI_Finalize);

int PMPI_Get_library_version(char *version, int *resultlen)
{
	*resultlen = snprintf(version, MPI_MAX_LIBRARY_VERSION_STRING,
			      "MPICH Version: 4.1.3 (greyhound test stand-in)");
	return MPI_SUCCESS;
}
ALIAS(MPI_Get_library_version);

int PMPI_Comm_size(MPI_Comm comm, int *size)
{
	if (!valid_comm(comm))
		return MPI_ERR_COMM;
	*size = 1;
	return MPI_SUCCESS;
}
ALIAS(MPI_Comm_size);

int PMPI_Comm_rank(MPI_Comm comm, int *rank)
{
	if (!valid_comm(comm))
		return MPI_ERR_COMM;
	*rank = 0;
	return MPI_SUCCESS;
}
ALIAS(MPI_Comm_rank);

int PMPI_Comm_dup(MPI_Comm comm, MPI_Comm *newcomm)
{
	if (!valid_comm(comm))
		return MPI_ERR_COMM;
	*newcomm = (MPI_Comm)((KIND_COMM_DUP << 24) | ++num_dups);
	return MPI_SUCCESS;
}
ALIAS(MPI_Comm_dup);

int PMPI_Comm_free(MPI_Comm *comm)
{
	if (!comm || KIND(*comm) != KIND_COMM_DUP)
		return MPI_ERR_COMM;
	*comm = MPI_COMM_NULL;
	return MPI_SUCCESS;
}
ALIAS(MPI_Comm_free);

int PMPI_Comm_group(MPI_Comm comm, MPI_Group *group)
{
	if (!valid_comm(comm))
		return MPI_ERR_COMM;
	*group = GROUP_OF_ONE;
	return MPI_SUCCESS;
}
ALIAS(MPI_Comm_group);

int PMPI_Group_translate_ranks(MPI_Group group1, int n, const int ranks1[], MPI_Group group2,
			       int ranks2[])
{
	if (group1 != GROUP_OF_ONE || group2 != GROUP_OF_ONE)
		return MPI_ERR_INTERN;
	for (int i = 0; i < n; i++)
		ranks2[i] = ranks1[i] == 0 ? 0 : MPI_UNDEFINED;
	return MPI_SUCCESS;
}
ALIAS(MPI_Group_translate_ranks);

int PMPI_Group_free(MPI_Group *group)
{
	*group = (MPI_Group)0x08000000;
	return MPI_SUCCESS;
}
ALIAS(MPI_Group_free);

int PMPI_Type_size(MPI_Datatype datatype, int *size)
{
	*size = type_size(datatype);
	return *size < 0 ? MPI_ERR_TYPE : MPI_SUCCESS;
}
ALIAS(MPI_Type_size);

int PMPI_Type_get_envelope(MPI_Datatype datatype, int *num_integers, int *num_addresses,
			   int *num_datatypes, int *combiner)
{
	if (type_size(datatype) < 0)
		return MPI_ERR_TYPE;
	*num_integers = *num_addresses = *num_datatypes = 0;
	*combiner = MPI_COMBINER_NAMED;
	return MPI_SUCCESS;
}
ALIAS(MPI_Type_get_envelope);

int PMPI_Send(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
	      MPI_Comm comm)
{
	int bytes = count * type_size(datatype);

	if (!initialised || !valid_comm(comm))
		return MPI_ERR_COMM;
	if (type_size(datatype) < 0)
		return MPI_ERR_TYPE;
	if (dest == MPI_PROC_NULL)
		return MPI_SUCCESS;
	if (dest != 0)
		return MPI_ERR_RANK;
	if (num_queued == MAX_MESSAGES || bytes > (int)sizeof(queue[0].data))
		return MPI_ERR_INTERN;
	queue[num_queued].comm = comm;
	queue[num_queued].tag = tag;
	queue[num_queued].bytes = bytes;
	memcpy(queue[num_queued].data, buf, (size_t)bytes);
	num_queued++;
	return MPI_SUCCESS;
}
ALIAS(MPI_Send);

/* The first queued message that matches, taken off the queue; -1 if none. */
static int take(void *buf, int bytes, int source, int tag, MPI_Comm comm, MPI_Status *status)
{
	for (int i = 0; i < num_queued; i++) {
		struct message *m = &queue[i];

		if (m->comm != comm || (tag != MPI_ANY_TAG && tag != m->tag) ||
		    (source != MPI_ANY_SOURCE && source != 0) || m->bytes > bytes)
			continue;
		memcpy(buf, m->data, (size_t)m->bytes);
		set_status(status, 0, m->tag, m->bytes);
		memmove(m, m + 1, (size_t)(num_queued - i - 1) * sizeof(*m));
		num_queued--;
		return 0;
	}
	return -1;
}

int PMPI_Recv(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm,
	      MPI_Status *status)
{
	if (!initialised || !valid_comm(comm))
		return MPI_ERR_COMM;
	if (type_size(datatype) < 0)
		return MPI_ERR_TYPE;
	if (source == MPI_PROC_NULL) {
		/* MPI: returns at once, source MPI_PROC_NULL, tag MPI_ANY_TAG, count 0. */
		set_status(status, MPI_PROC_NULL, MPI_ANY_TAG, 0);
		return MPI_SUCCESS;
	}
	/* One process: a receive nothing was sent for would never complete. */
	return take(buf, count * type_size(datatype), source, tag, comm, status) == 0
		       ? MPI_SUCCESS : MPI_ERR_INTERN;
}
ALIAS(MPI_Recv);

int PMPI_Isend(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
	       MPI_Comm comm, MPI_Request *request)
{
	int rc = PMPI_Send(buf, count, datatype, dest, tag, comm);

	*request = rc == MPI_SUCCESS ? (MPI_Request)0x2c000001 : MPI_REQUEST_NULL;
	return rc;
}
ALIAS(MPI_Isend);

int PMPI_Irecv(void *buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm,
	       MPI_Request *request)
{
	if (!valid_comm(comm))
		return MPI_ERR_COMM;
	if (type_size(datatype) < 0)
		return MPI_ERR_TYPE;
	for (int i = 0; i < MAX_REQUESTS; i++) {
		if (pending_recv[i].in_use)
			continue;
		pending_recv[i].in_use = 1;
		pending_recv[i].buf = buf;
		pending_recv[i].bytes = count * type_size(datatype);
		pending_recv[i].source = source;
		pending_recv[i].tag = tag;
		pending_recv[i].comm = comm;
		*request = (MPI_Request)(0x2c000100 + i);
		return MPI_SUCCESS;
	}
	return MPI_ERR_INTERN;
}
ALIAS(MPI_Irecv);

int PMPI_Wait(MPI_Request *request, MPI_Status *status)
{
	int i = *request - 0x2c000100, rc = MPI_SUCCESS;

	if (i >= 0 && i < MAX_REQUESTS && pending_recv[i].in_use) {
		if (pending_recv[i].source == MPI_PROC_NULL)
			set_status(status, MPI_PROC_NULL, MPI_ANY_TAG, 0);
		else if (take(pending_recv[i].buf, pending_recv[i].bytes, pending_recv[i].source,
			      pending_recv[i].tag, pending_recv[i].comm, status) != 0)
			rc = MPI_ERR_INTERN;
		pending_recv[i].in_use = 0;
	} else {
		set_status(status, MPI_ANY_SOURCE, MPI_ANY_TAG, 0);
	}
	*request = MPI_REQUEST_NULL;
	return rc;
}
ALIAS(MPI_Wait);

int PMPI_Waitall(int count, MPI_Request requests[], MPI_Status *statuses)
{
	int rc = MPI_SUCCESS;

	for (int i = 0; i < count; i++) {
		int r = PMPI_Wait(&requests[i], statuses == MPI_STATUSES_IGNORE
							   ? MPI_STATUS_IGNORE : &statuses[i]);

		if (r != MPI_SUCCESS)
			rc = r;
	}
	return rc;
}
ALIAS(MPI_Waitall);

int PMPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
		   MPI_Op op, MPI_Comm comm)
{
	(void)op;
	if (!initialised || !valid_comm(comm))
		return MPI_ERR_COMM;
	if (type_size(datatype) < 0)
		return MPI_ERR_TYPE;
	/* One member: the result is the input. */
	if (sendbuf != MPI_IN_PLACE && count > 0)
		memmove(recvbuf, sendbuf, (size_t)count * (size_t)type_size(datatype));
	return MPI_SUCCESS;
}
ALIAS(MPI_Allreduce);

int PMPI_Bcast(void *buffer, int count, MPI_Datatype datatype, int root, MPI_Comm comm)
{
	(void)buffer;
	(void)count;
	if (!valid_comm(comm))
		return MPI_ERR_COMM;
	if (type_size(datatype) < 0)
		return MPI_ERR_TYPE;
	return root == 0 ? MPI_SUCCESS : MPI_ERR_RANK;
}
ALIAS(MPI_Bcast);

int PMPI_Barrier(MPI_Comm comm)
{
	return valid_comm(comm) ? MPI_SUCCESS : MPI_ERR_COMM;
}
ALIAS(MPI_Barrier);
