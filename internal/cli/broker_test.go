package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/transport/nats"
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
	if !strings.Contains(out, `"oldest_transaction_age_seconds":`) {
		t.Errorf("status --json lacks oldest_transaction_age_seconds: %s", out)
	}
	got := map[string]bool{}
	for _, q := range res.Status.Queues.Consumers {
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
		url = nats.DefaultURL
	}
	nc, err := natsgo.Connect(url, natsgo.Timeout(2*time.Second))
	if err != nil {
		t.Skipf("no NATS server at %s: %v", url, err)
	}
	defer nc.Close()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	topo := nats.Holdco()
	topo.Stream = "T" + id + "_CLI"
	topo.SubjectPrefix = "t" + id + ".cli"
	t.Cleanup(func() {
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, topo.Stream)
		_ = js.DeleteStream(ctx, topo.Stream+"_DLQ")
	})
	prov, err := nats.NewProvisioner(nats.Config{URL: url, Topology: topo})
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
	if !strings.Contains(out, `"oldest_transaction_age_seconds":`) {
		t.Errorf("status --json lacks oldest_transaction_age_seconds: %s", out)
	}
	got := map[string]bool{}
	for _, q := range res.Status.Queues.Consumers {
		if q.Error != "" {
			t.Errorf("%s: %s", q.Consumer, q.Error)
		}
		got[q.Consumer] = true
	}
	if len(got) != 3 || !got["analytics"] || !got["erp"] || !got["notifications"] {
		t.Fatalf("consumers %v, want holdco's analytics, erp and notifications", got)
	}
}

// `fifobox provision` then `fifobox consume` with FIFOBOX_TRANSPORT=nats,
// as a NATS deployment on AWS runs its consumers (no Lambda event source):
// provisioning twice changes nothing; the consumer applies published
// events through the inbox in order, once, and stops cleanly when its
// context ends (SIGTERM in a task).
func TestProvisionAndConsumeThroughNATS(t *testing.T) {
	url := os.Getenv("FIFOBOX_TEST_NATS_URL")
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := natsgo.Connect(url, natsgo.Timeout(2*time.Second))
	if err != nil {
		t.Skipf("no NATS server at %s: %v", url, err)
	}
	defer nc.Close()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	stream, prefix := "T"+id+"_CONSUME", "t"+id+".consume"
	t.Cleanup(func() {
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, stream)
		_ = js.DeleteStream(ctx, stream+"_DLQ")
	})
	db := pgtest.New(t)
	dbURL := pgtest.WithSearchPath(pgtest.URL(), db.Schema)
	t.Setenv("FIFOBOX_TRANSPORT", "nats")
	t.Setenv("FIFOBOX_NATS_URL", url)
	t.Setenv("FIFOBOX_NATS_TOPOLOGY", "default")
	t.Setenv("FIFOBOX_NATS_STREAM", stream)
	t.Setenv("FIFOBOX_NATS_SUBJECT_PREFIX", prefix)
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	for i := range 2 {
		out, errOut, err := runCLI(t, "provision")
		if err != nil || !strings.HasPrefix(out, "nats topology provisioned: NATS JetStream") {
			t.Fatalf("provision %d: %q %v: %s", i, out, err, errOut)
		}
	}

	cfg, err := nats.ConfigFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := nats.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	ctx := context.Background()
	for step, typ := range []string{"order.created", "order.paid", "order.shipped"} {
		var msgs []outbox.Message
		for o := range 3 {
			e, err := envelope.New(typ, "order", fmt.Sprintf("o-%d", o), readmodel.OrderEvent{OrderID: fmt.Sprintf("o-%d", o), CustomerID: "c", AmountCents: 100, Currency: "EUR"})
			if err != nil {
				t.Fatal(err)
			}
			e.Sequence = int64(step + 1)
			body, err := e.Encode()
			if err != nil {
				t.Fatal(err)
			}
			msgs = append(msgs, outbox.Message{EventID: e.ID, GroupID: e.AggregateID, AggregateType: e.AggregateType,
				Sequence: e.Sequence, EventType: e.Type, Body: body, Attributes: e.Attributes(), Attempt: 1})
		}
		for i, err := range pub.Publish(ctx, msgs) {
			if err != nil {
				t.Fatalf("publish %d: %v", i, err)
			}
		}
	}

	cctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	var out, errOut bytes.Buffer
	go func() {
		a := &app{out: &out, errOut: &errOut}
		root := a.rootCmd()
		root.SetArgs([]string{"--database-url", dbURL, "consume", "--consumer", "orders-projection"})
		done <- root.ExecuteContext(cctx)
	}()
	var shipped int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders_read_model WHERE status = 'shipped' AND event_count = 3`).Scan(&shipped); err != nil {
			t.Fatal(err)
		}
		if shipped == 3 {
			break
		}
	}
	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("consume returned %v after its context ended", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("consume did not stop within 15 s of its context ending")
	}
	if shipped != 3 {
		t.Fatalf("%d of 3 orders shipped after their 3 events each; stderr:\n%s", shipped, errOut.String())
	}
	var inboxRows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE consumer = 'orders-projection'`).Scan(&inboxRows); err != nil || inboxRows != 9 {
		t.Errorf("inbox rows %d (%v), want 9", inboxRows, err)
	}

	t.Setenv("FIFOBOX_TRANSPORT", "sns")
	if _, _, err := runCLI(t, "consume", "--consumer", "orders-projection"); err == nil || !strings.Contains(err.Error(), "FIFOBOX_TRANSPORT") {
		t.Errorf("consume with sns: %v, want an error naming FIFOBOX_TRANSPORT", err)
	}
}
