/* A small MPI program for the acceptance suite: a ping-pong, an allreduce and a 64 MiB
 * alltoall between the ranks, each result checked. Prints one line per part and exits
 * non-zero on the first wrong value. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(int rank, const char *what) {
    fprintf(stderr, "rank %d: %s\n", rank, what);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
}

int main(int argc, char **argv) {
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size < 2)
        return fail(rank, "needs two ranks");

    /* Ping-pong: 1000 round trips of 4 KiB between ranks 0 and 1, the payload changing
     * each time; the latency is printed. */
    enum { PP_LEN = 4096, PP_ITERS = 1000 };
    unsigned char *buf = malloc(PP_LEN);
    double t0 = MPI_Wtime();
    for (int i = 0; i < PP_ITERS; i++) {
        if (rank == 0) {
            memset(buf, (unsigned char)i, PP_LEN);
            MPI_Send(buf, PP_LEN, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
            MPI_Recv(buf, PP_LEN, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int k = 0; k < PP_LEN; k++)
                if (buf[k] != (unsigned char)(i + 1))
                    return fail(rank, "ping-pong payload wrong");
        } else if (rank == 1) {
            MPI_Recv(buf, PP_LEN, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int k = 0; k < PP_LEN; k++)
                if (buf[k] != (unsigned char)i)
                    return fail(rank, "ping payload wrong");
            memset(buf, (unsigned char)(i + 1), PP_LEN);
            MPI_Send(buf, PP_LEN, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
        }
    }
    double rtt = (MPI_Wtime() - t0) / PP_ITERS * 1e6;
    free(buf);
    if (rank == 0)
        printf("pingpong: %d x %d bytes, %.2f us round trip\n", PP_ITERS, PP_LEN, rtt);

    /* Allreduce of 1 Mi doubles: element k of rank r is r + k, so the sum is known. */
    enum { AR_LEN = 1 << 20 };
    double *in = malloc(AR_LEN * sizeof *in), *out = malloc(AR_LEN * sizeof *out);
    for (int k = 0; k < AR_LEN; k++)
        in[k] = rank + (double)k;
    MPI_Allreduce(in, out, AR_LEN, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    double ranks = (double)size * (size - 1) / 2;
    for (int k = 0; k < AR_LEN; k++)
        if (out[k] != ranks + (double)size * k)
            return fail(rank, "allreduce sum wrong");
    free(in);
    free(out);
    if (rank == 0)
        printf("allreduce: %d doubles ok\n", AR_LEN);

    /* Alltoall of 64 MiB per rank: each block is tagged with its source and destination. */
    size_t total = 64u << 20, block = total / size / sizeof(uint64_t);
    uint64_t *send = malloc(total), *recv = malloc(total);
    for (int d = 0; d < size; d++)
        for (size_t k = 0; k < block; k++)
            send[d * block + k] = ((uint64_t)rank << 48) | ((uint64_t)d << 32) | k;
    t0 = MPI_Wtime();
    MPI_Alltoall(send, (int)block, MPI_UINT64_T, recv, (int)block, MPI_UINT64_T, MPI_COMM_WORLD);
    double secs = MPI_Wtime() - t0;
    for (int s = 0; s < size; s++)
        for (size_t k = 0; k < block; k++)
            if (recv[s * block + k] != (((uint64_t)s << 48) | ((uint64_t)rank << 32) | k))
                return fail(rank, "alltoall block wrong");
    free(send);
    free(recv);
    if (rank == 0)
        printf("alltoall: 64 MiB per rank ok in %.3f s\n", secs);
    MPI_Finalize();
    return 0;
}
