/*
 * The ping-pong server of the rdma_cm tutorial (seed 003), laid out as the tutorial lays
 * it out. The listener (rdma_getaddrinfo, rdma_create_ep, rdma_listen, rdma_get_request)
 * hands each connection to an agent (ibv_create_cq, rdma_create_qp, rdma_reg_msgs,
 * rdma_accept, rdma_post_recv; then ibv_poll_cq, rdma_post_send per ping; then
 * rdma_disconnect and the breakdown). It serves -c connections, one after another.
 *
 * Build against the system's headers: cc -o tutorial_server tutorial_server.c -lrdmacm -libverbs
 * Usage: tutorial_server [-a ADDRESS] [-p PORT] [-n COUNT] [-s SIZE] [-c CONNECTIONS]
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

/* The agent: one client's connection, from accept to breakdown. */
static int agent(struct rdma_cm_id *id, int count, int size)
{
	int i, ret = 1;

	/* 2. create completion queue to get CA status */
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 16, NULL, NULL, 0);
	if (!cq) {
		perror("ibv_create_cq");
		return 1;
	}
	/* 3. create queue pair to give CA xfer metadata */
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
	/* 4. allocate user virtual memory */
	char *buf = malloc(size);
	if (!buf)
		goto out_qp;
	/* 5. register user virtual memory with CA */
	struct ibv_mr *mr = rdma_reg_msgs(id, buf, size);
	if (!mr) {
		perror("rdma_reg_msgs");
		goto out_mem;
	}
	/* 6. finalize connection with client */
	if (rdma_accept(id, NULL)) {
		perror("rdma_accept");
		goto out_mr;
	}
	/* 7. post first receive of ping data from client */
	if (rdma_post_recv(id, NULL, buf, size, mr)) {
		perror("rdma_post_recv");
		goto out_disc;
	}
	/* 8. mark start time for statistics */
	struct timeval start, stop;
	gettimeofday(&start, NULL);
	/* 9. start of transfer loop */
	for (i = 0; i < count; i++) {
		struct ibv_wc wc;

		/* 10. wait to receive ping data from client */
		if (poll_one(cq, &wc))
			goto out_disc;
		if ((int)wc.byte_len != size) {
			fprintf(stderr, "ping %d: %u bytes, expected %d\n", i, wc.byte_len, size);
			goto out_disc;
		}
		/* 12. post send to start transfer of pong data to client; the next ping's
		 * receive first, so that it is posted before the client can send it */
		if (rdma_post_send(id, NULL, buf, size, mr, 0)) {
			perror("rdma_post_send");
			goto out_disc;
		}
		/* 13. wait for send to complete */
		if (poll_one(cq, &wc))
			goto out_disc;
		if (i + 1 < count && rdma_post_recv(id, NULL, buf, size, mr)) {
			perror("rdma_post_recv");
			goto out_disc;
		}
	} /* 14. end of transfer loop */
	/* 15. mark stop time and print statistics */
	gettimeofday(&stop, NULL);
	printf("served %d pings of %d bytes in %.0f usec\n", count, size,
	       (stop.tv_sec - start.tv_sec) * 1e6 + (stop.tv_usec - start.tv_usec));
	ret = 0;
out_disc:
	rdma_disconnect(id);
out_mr:
	rdma_dereg_mr(mr);
out_mem:
	free(buf);
out_qp:
	rdma_destroy_qp(id);
out_cq:
	ibv_destroy_cq(cq);
	rdma_destroy_ep(id);
	return ret;
}

int main(int argc, char **argv)
{
	/* 1. process command-line options */
	const char *addr = NULL, *port = "7471";
	int count = 1000, size = 64, conns = 1, op, ret = 0;

	while ((op = getopt(argc, argv, "a:p:n:s:c:")) != -1) {
		switch (op) {
		case 'a': addr = optarg; break;
		case 'p': port = optarg; break;
		case 'n': count = atoi(optarg); break;
		case 's': size = atoi(optarg); break;
		case 'c': conns = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s [-a ADDRESS] [-p PORT] [-n COUNT] [-s SIZE] [-c CONNECTIONS]\n", argv[0]);
			return 1;
		}
	}
	if (count <= 0 || size <= 0 || conns <= 0) {
		fprintf(stderr, "count, size and connections must be positive\n");
		return 1;
	}

	/* 2. convert DNS name and port no. */
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	int err = rdma_getaddrinfo(addr, port, &hints, &res);
	if (err) {
		fprintf(stderr, "rdma_getaddrinfo: %s\n", gai_strerror(err));
		return 1;
	}
	/* 3. create local end point */
	struct rdma_cm_id *listen_id, *id;
	if (rdma_create_ep(&listen_id, res, NULL, NULL)) {
		perror("rdma_create_ep");
		rdma_freeaddrinfo(res);
		return 1;
	}
	/* 5. establish socket as listener */
	if (rdma_listen(listen_id, 0)) {
		perror("rdma_listen");
		ret = 1;
		goto out;
	}
	/* 6. start loop */
	for (int c = 0; c < conns && !ret; c++) {
		/* 7. get connection request from client */
		if (rdma_get_request(listen_id, &id)) {
			perror("rdma_get_request");
			ret = 1;
			break;
		}
		/* 8. hand connection over to agent */
		ret = agent(id, count, size);
	} /* 9. end loop */
out:
	/* 10. destroy local endpoint */
	rdma_destroy_ep(listen_id);
	/* 11. free getaddrinfo resources */
	rdma_freeaddrinfo(res);
	return ret;
}
