/*
 * The ping-pong client of the rdma_cm tutorial (seed 003), laid out as the tutorial lays
 * it out: setup (rdma_getaddrinfo, rdma_create_ep, ibv_create_cq, rdma_create_qp,
 * rdma_reg_msgs, rdma_connect), use (rdma_post_recv, rdma_post_send, ibv_poll_cq, memcmp),
 * breakdown (rdma_disconnect, rdma_dereg_mr, rdma_destroy_qp, ibv_destroy_cq,
 * rdma_destroy_ep, rdma_freeaddrinfo).
 *
 * Build against the system's headers: cc -o tutorial_client tutorial_client.c -lrdmacm -libverbs
 * Usage: tutorial_client -a SERVER [-b SOURCE] [-p PORT] [-n COUNT] [-s SIZE]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netdb.h>
#include <sys/time.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
	int n;

	while ((n = ibv_poll_cq(cq, 1, wc)) == 0)
		;
	if (n < 0 || wc->status != IBV_WC_SUCCESS) {
		fprintf(stderr, "completion failed: %s\n",
			n < 0 ? "poll error" : ibv_wc_status_str(wc->status));
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	/* 1. process command-line options */
	const char *server = NULL, *source = NULL, *port = "7471";
	int count = 1000, size = 64, op, i, ret = 1;

	while ((op = getopt(argc, argv, "a:b:p:n:s:")) != -1) {
		switch (op) {
		case 'a': server = optarg; break;
		case 'b': source = optarg; break;
		case 'p': port = optarg; break;
		case 'n': count = atoi(optarg); break;
		case 's': size = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s -a SERVER [-b SOURCE] [-p PORT] [-n COUNT] [-s SIZE]\n", argv[0]);
			return 1;
		}
	}
	if (!server || count <= 0 || size <= 0) {
		fprintf(stderr, "usage: %s -a SERVER [-b SOURCE] [-p PORT] [-n COUNT] [-s SIZE]\n", argv[0]);
		return 1;
	}

	/* 2. convert DNS name and port no. */
	struct rdma_addrinfo hints, *res, *src = NULL;
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	if (source) {
		hints.ai_flags = RAI_PASSIVE;
		if (rdma_getaddrinfo(source, NULL, &hints, &src)) {
			perror("rdma_getaddrinfo (source)");
			return 1;
		}
		hints.ai_flags = 0;
		hints.ai_src_addr = src->ai_src_addr;
		hints.ai_src_len = src->ai_src_len;
	}
	int err = rdma_getaddrinfo(server, port, &hints, &res);
	if (err) {
		fprintf(stderr, "rdma_getaddrinfo: %s\n", gai_strerror(err));
		return 1;
	}

	/* 3. create local end point */
	struct rdma_cm_id *id;
	if (rdma_create_ep(&id, res, NULL, NULL)) {
		perror("rdma_create_ep");
		goto out_addr;
	}

	/* 4. create completion queue to get CA status */
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 16, NULL, NULL, 0);
	if (!cq) {
		perror("ibv_create_cq");
		goto out_ep;
	}

	/* 5. create queue pair to give CA xfer metadata */
	struct ibv_qp_init_attr attr;
	memset(&attr, 0, sizeof attr);
	attr.send_cq = cq;
	attr.recv_cq = cq;
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.qp_type = IBV_QPT_RC;
	attr.sq_sig_all = 1;
	if (rdma_create_qp(id, NULL, &attr)) {
		perror("rdma_create_qp");
		goto out_cq;
	}

	/* 6. allocate user virtual memory */
	char *ping = malloc(size), *pong = malloc(size);
	if (!ping || !pong)
		goto out_qp;

	/* 7. register user virtual memory with CA */
	struct ibv_mr *ping_mr = rdma_reg_msgs(id, ping, size);
	struct ibv_mr *pong_mr = rdma_reg_msgs(id, pong, size);
	if (!ping_mr || !pong_mr) {
		perror("rdma_reg_msgs");
		goto out_mem;
	}

	/* 8. create connection with server */
	if (rdma_connect(id, NULL)) {
		perror("rdma_connect");
		goto out_mr;
	}

	/* 9. mark start time for statistics */
	struct timeval start, stop;
	gettimeofday(&start, NULL);
	/* 10. start of transfer loop */
	for (i = 0; i < count; i++) {
		struct ibv_wc wc[2];

		memset(ping, 'a' + i % 26, size);
		memset(pong, 0, size);
		/* 11. post receive to catch agent's pong data */
		if (rdma_post_recv(id, NULL, pong, size, pong_mr)) {
			perror("rdma_post_recv");
			goto out_disc;
		}
		/* 12. post send to start transfer of ping data to agent */
		if (rdma_post_send(id, NULL, ping, size, ping_mr, 0)) {
			perror("rdma_post_send");
			goto out_disc;
		}
		/* 13. wait for both send and receive to complete */
		if (poll_one(cq, &wc[0]) || poll_one(cq, &wc[1]))
			goto out_disc;
		/* 14. optionally verify pong data ok */
		if (memcmp(ping, pong, size)) {
			fprintf(stderr, "pong %d differs from its ping\n", i);
			goto out_disc;
		}
	} /* 15. end of transfer loop */
	/* 16. mark stop time and print statistics */
	gettimeofday(&stop, NULL);
	double usec = (stop.tv_sec - start.tv_sec) * 1e6 + (stop.tv_usec - start.tv_usec);
	printf("%d round trips of %d bytes in %.0f usec: %.2f usec per round trip\n",
	       count, size, usec, usec / count);
	ret = 0;

out_disc:
	/* 17. break connection with server */
	rdma_disconnect(id);
out_mr:
	/* 18. deregister user virtual memory */
	if (ping_mr)
		rdma_dereg_mr(ping_mr);
	if (pong_mr)
		rdma_dereg_mr(pong_mr);
out_mem:
	/* 19. free user virtual memory */
	free(ping);
	free(pong);
out_qp:
	/* 20. destroy queue pair */
	rdma_destroy_qp(id);
out_cq:
	/* 21. destroy completion queue */
	ibv_destroy_cq(cq);
out_ep:
	/* 22. destroy local end point */
	rdma_destroy_ep(id);
out_addr:
	/* 23. free rdma_getaddrinfo resources */
	rdma_freeaddrinfo(res);
	if (src)
		rdma_freeaddrinfo(src);
	return ret;
}
