package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	natsbus "github.com/fifobox/fifobox/pkg/transport/nats"
)

// With FIFOBOX_TRANSPORT=rabbitmq, `fifobox status` reports the RabbitMQ
// topology's queues (here holdco's, in a test vhost) instead of SQS's.
func TestStatusThroughRabbitMQ(t *testing.T) {
	v := amqptest.New(t)
	prov, err := amqp.NewProvisioner(amqp.Config{URL: v.URL, Topology: amqp.Holdco()})
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(context.Background()); err != nil {
		t.Fatal(err)
	}
	db := pgtest.New(t)
	t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
	t.Setenv("FIFOBOX_AMQP_URL", v.URL)
	t.Setenv("FIFOBOX_AMQP_TOPOLOGY", "holdco")
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	out, errOut, err := runCLI(t, "--database-url", pgtest.WithSearchPath(pgtest.URL(), db.Schema), "--json", "status")
	if err != nil {
		t.Fatalf("status: %v: %s", err, errOut)
	}
	var res redrive.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.Status == nil {
		t.Fatalf("output %q: %v", out, err)
	}
	got := map[string]bool{}
	for _, q := range res.Status.Queues {
		if q.Error != "" {
			t.Errorf("%s: %s", q.Consumer, q.Error)
		}
		got[q.Consumer] = true
	}
	if len(got) != 3 || !got["analytics"] || !got["erp"] || !got["notifications"] {
		t.Fatalf("queues %v, want holdco's analytics, erp and notifications", got)
	}
	t.Setenv("FIFOBOX_TRANSPORT", "kafka")
	if _, _, err := runCLI(t, "--database-url", pgtest.WithSearchPath(pgtest.URL(), db.Schema), "status"); err == nil {
		t.Error("FIFOBOX_TRANSPORT=kafka accepted")
	}
}

// TestStatusThroughNATS: with FIFOBOX_TRANSPORT=nats, status reads each
// consumer's figures from JetStream (a stream and subject prefix of this
// test's own on the machine's NATS server).
func TestStatusThroughNATS(t *testing.T) {
	url := os.Getenv("FIFOBOX_TEST_NATS_URL")
	if url == "" {
		url = natsbus.DefaultURL
	}
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second))
	if err != nil {
		t.Skipf("no NATS server at %s: %v", url, err)
	}
	defer nc.Close()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	topo := natsbus.Holdco()
	topo.Stream = "T" + id + "_CLI"
	topo.SubjectPrefix = "t" + id + ".cli"
	t.Cleanup(func() {
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, topo.Stream)
		_ = js.DeleteStream(ctx, topo.Stream+"_DLQ")
	})
	prov, err := natsbus.NewProvisioner(natsbus.Config{URL: url, Topology: topo})
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(context.Background()); err != nil {
		t.Fatal(err)
	}
	db := pgtest.New(t)
	t.Setenv("FIFOBOX_TRANSPORT", "nats")
	t.Setenv("FIFOBOX_NATS_URL", url)
	t.Setenv("FIFOBOX_NATS_TOPOLOGY", "holdco")
	t.Setenv("FIFOBOX_NATS_STREAM", topo.Stream)
	t.Setenv("FIFOBOX_NATS_SUBJECT_PREFIX", topo.SubjectPrefix)
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	out, errOut, err := runCLI(t, "--database-url", pgtest.WithSearchPath(pgtest.URL(), db.Schema), "--json", "status")
	if err != nil {
		t.Fatalf("status: %v: %s", err, errOut)
	}
	var res redrive.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.Status == nil {
		t.Fatalf("output %q: %v", out, err)
	}
	got := map[string]bool{}
	for _, q := range res.Status.Queues {
		if q.Error != "" {
			t.Errorf("%s: %s", q.Consumer, q.Error)
		}
		got[q.Consumer] = true
	}
	if len(got) != 3 || !got["analytics"] || !got["erp"] || !got["notifications"] {
		t.Fatalf("consumers %v, want holdco's analytics, erp and notifications", got)
	}
}
