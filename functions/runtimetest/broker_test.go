package runtimetest

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/lambdaruntime"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/transport/nats"
)

// secretsManager stands in for AWS Secrets Manager (no emulator for it runs
// here): it answers GetSecretValue for arn with value, as the JSON 1.1
// protocol the SDK speaks, and counts the reads.
func secretsManager(t *testing.T, arn, value string) (endpoint string, reads *atomic.Int64) {
	t.Helper()
	reads = new(atomic.Int64)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ SecretId string }
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &in)
		w.Header().Set("Content-Type", "application/x-amz-json-1.1")
		if r.Header.Get("X-Amz-Target") != "secretsmanager.GetSecretValue" || in.SecretId != arn {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, `{"__type":"ResourceNotFoundException","message":"no secret %s"}`, in.SecretId)
			return
		}
		reads.Add(1)
		out, _ := json.Marshal(map[string]any{"ARN": arn, "Name": "broker", "VersionId": "v1", "SecretString": value, "CreatedDate": 1.7e9})
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, reads
}

// brokerEnv is what a function's configuration holds in a broker variant
// (infra: -c transport=...), with the database and endpoints this test
// resolves it to.
func brokerEnv(fn string, db *pgtest.DB, vars ...string) []string {
	env := append(lambdaruntime.PlatformEnv("Fifobox-"+fn, 256), "FIFOBOX_DATABASE_URL="+db.URL, "FIFOBOX_METRICS_NAMESPACE=Fifobox")
	return append(env, vars...)
}

// The dispatcher and consumer bootstraps with FIFOBOX_TRANSPORT=rabbitmq,
// as the Amazon MQ variant configures them (broker URL without
// credentials, the user from a Secrets Manager secret): the dispatcher
// publishes the outbox to the broker; the consumer, invoked with the
// records as Lambda's Amazon MQ event source delivers them, applies each
// once in order, dead-letters a bad record without failing the others,
// and answers a redelivered batch without applying anything twice.
func TestBinariesThroughRabbitMQ(t *testing.T) {
	v := amqptest.New(t)
	db := pgtest.New(t)
	ctx := context.Background()

	topo, err := amqp.LoadTopology("default")
	if err != nil {
		t.Fatal(err)
	}
	prov, err := amqp.NewProvisioner(amqp.Config{URL: v.URL, Topology: topo})
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	cons, ok := topo.Consumer("orders-projection")
	if !ok {
		t.Fatal("default topology has no orders-projection consumer")
	}

	// The function's URL carries no credentials; they come from the secret.
	const arn = "arn:aws:secretsmanager:us-east-1:111111111111:secret:fifobox-amqp-AbCdEf"
	endpoint, reads := secretsManager(t, arn, `{"username":"guest","password":"guest"}`)
	bare := strings.Replace(v.URL, "guest:guest@", "", 1)
	broker := []string{"FIFOBOX_TRANSPORT=rabbitmq", "FIFOBOX_AMQP_URL=" + bare, "FIFOBOX_AMQP_TOPOLOGY=default",
		"FIFOBOX_AMQP_SECRET_ARN=" + arn, "AWS_ENDPOINT_URL_SECRETS_MANAGER=" + endpoint}

	var evs []envelope.Envelope
	for i := range 12 {
		evs = append(evs, orderEvent(t, []string{"order.created", "order.paid", "order.shipped"}[i/4], fmt.Sprintf("o-%d", i%4)))
	}
	enqueue(t, db, evs...)

	dsrv := lambdaruntime.NewServer(t, "dispatcher")
	dfn := dsrv.Start(bootstrap(t, "dispatcher"), brokerEnv("dispatcher", db, broker...))
	res := invoke(t, dsrv, []byte(`{}`), 8*time.Second)
	if res.Err != nil {
		t.Fatalf("dispatcher invocation failed: %s\n%s", res, dfn.Output())
	}
	var out dispatcher.Result
	if err := json.Unmarshal(res.Response, &out); err != nil || out.Published != int64(len(evs)) || out.Dead != 0 {
		t.Fatalf("dispatcher response %s (%v): want %d published, none dead", res.Response, err, len(evs))
	}
	if reads.Load() != 1 {
		t.Errorf("the dispatcher read the secret %d times, want once at init", reads.Load())
	}

	// Take the queue's messages as the event source would, then add a
	// record that is not an event.
	ds := drain(t, v.URL, cons.QueueName(), len(evs))
	ds = append(ds, amqp091.Delivery{MessageId: "not-an-event", ContentType: "application/json", Body: []byte(`{"hello":`), DeliveryMode: 2})
	payload := rabbitMQEvent(t, cons.QueueName(), v.Name, ds)

	csrv := lambdaruntime.NewServer(t, "consumer")
	cfn := csrv.Start(bootstrap(t, "consumer"), brokerEnv("consumer", db, append(broker, "FIFOBOX_CONSUMER_NAME=orders-projection")...))
	for round := range 2 { // the second is Lambda redelivering the batch
		res = invoke(t, csrv, payload, 20*time.Second)
		if res.Err != nil {
			t.Fatalf("consumer invocation %d failed: %s\n%s", round, res, cfn.Output())
		}
	}
	var applied, rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE consumer = 'orders-projection'`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders_read_model WHERE status = 'shipped' AND event_count = 3 AND last_sequence = 3`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if applied != len(evs) || rows != 4 {
		t.Errorf("inbox has %d events, %d orders shipped after 3 events each; want %d and 4 (each applied once, in order)", applied, rows, len(evs))
	}
	ops, err := amqp.NewOperations(amqp.Config{URL: v.URL, Topology: topo, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	depths, err := ops.Depths(ctx, "orders-projection")
	if err != nil {
		t.Fatal(err)
	}
	if len(depths) != 1 || depths[0].DLQ != 2 {
		// Two: the bad record is dead-lettered on each delivery of the batch.
		t.Errorf("orders-projection DLQ: %+v, want the bad record there twice (once per delivery)", depths)
	}
	if !strings.Contains(cfn.Output(), `"Processed"`) || !strings.Contains(cfn.Output(), `"Duplicates"`) {
		t.Errorf("no consumer metrics on stdout:\n%s", cfn.Output())
	}
}

// drain takes want messages from queue, acknowledging them as Lambda's
// event source does once the function succeeds.
func drain(t *testing.T, url, queue string, want int) []amqp091.Delivery {
	t.Helper()
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	// Quorum queues with a single active consumer refuse basic.get; the
	// event source consumes, as this does.
	if err := ch.Qos(want, 0, false); err != nil {
		t.Fatal(err)
	}
	msgs, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got []amqp091.Delivery
	timeout := time.After(10 * time.Second)
	for len(got) < want {
		select {
		case d := <-msgs:
			got = append(got, d)
		case <-timeout:
			t.Fatalf("queue %s: %d messages, want %d", queue, len(got), want)
		}
	}
	if err := got[len(got)-1].Ack(true); err != nil {
		t.Fatal(err)
	}
	if len(got) != want {
		t.Fatalf("queue %s: %d messages, want %d", queue, len(got), want)
	}
	return got
}

// rabbitMQEvent renders deliveries as Lambda's Amazon MQ event source does:
// base64 data, string headers as {"bytes": [...]}, keyed "queue::vhost".
func rabbitMQEvent(t *testing.T, queue, vhost string, ds []amqp091.Delivery) []byte {
	t.Helper()
	var msgs []map[string]any
	for _, d := range ds {
		headers := map[string]any{}
		for k, v := range d.Headers {
			if s, ok := v.(string); ok {
				b := make([]int, len(s))
				for i := range len(s) {
					b[i] = int(s[i])
				}
				headers[k] = map[string]any{"bytes": b}
				continue
			}
			headers[k] = v
		}
		msgs = append(msgs, map[string]any{
			"basicProperties": map[string]any{"contentType": d.ContentType, "headers": headers, "deliveryMode": d.DeliveryMode,
				"messageId": d.MessageId, "type": d.Type, "bodySize": len(d.Body)},
			"redelivered": d.Redelivered,
			"data":        base64.StdEncoding.EncodeToString(d.Body),
		})
	}
	raw, err := json.Marshal(map[string]any{"eventSource": "aws:rmq", "eventSourceArn": "arn:aws:mq:us-east-1:111111111111:broker:fifobox:b-1",
		"rmqMessagesByQueue": map[string]any{queue + "::" + vhost: msgs}})
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// The dispatcher bootstrap with FIFOBOX_TRANSPORT=nats, as the NATS variant
// configures it, publishes the outbox to the JetStream stream, in order per
// aggregate, each event once (Nats-Msg-Id = event id).
func TestDispatcherBinaryThroughNATS(t *testing.T) {
	url := nats.DefaultURL
	nc, err := natsgo.Connect(url, natsgo.Timeout(2*time.Second))
	if err != nil {
		t.Skipf("no NATS server at %s (scripts/ensure-nats.sh starts one): %v", url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	stream, prefix := "T"+id+"_FIFOBOX", "t"+id+".fifobox"
	topo, err := nats.LoadTopology("default")
	if err != nil {
		t.Fatal(err)
	}
	topo.Stream, topo.DeadLetterStream, topo.SubjectPrefix = stream, "", prefix
	prov, err := nats.NewProvisioner(nats.Config{URL: url, Topology: topo, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = js.DeleteStream(context.Background(), stream)
		_ = js.DeleteStream(context.Background(), stream+"_DLQ")
	})
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}

	db := pgtest.New(t)
	var evs []envelope.Envelope
	for i := range 12 {
		evs = append(evs, orderEvent(t, []string{"order.created", "order.paid", "order.shipped"}[i/4], fmt.Sprintf("o-%d", i%4)))
	}
	enqueue(t, db, evs...)
	srv := lambdaruntime.NewServer(t, "dispatcher")
	fn := srv.Start(bootstrap(t, "dispatcher"), brokerEnv("dispatcher", db, "FIFOBOX_TRANSPORT=nats", "FIFOBOX_NATS_URL="+url,
		"FIFOBOX_NATS_TOPOLOGY=default", "FIFOBOX_NATS_STREAM="+stream, "FIFOBOX_NATS_SUBJECT_PREFIX="+prefix))
	res := invoke(t, srv, []byte(`{}`), 8*time.Second)
	if res.Err != nil {
		t.Fatalf("dispatcher invocation failed: %s\n%s", res, fn.Output())
	}
	var out dispatcher.Result
	if err := json.Unmarshal(res.Response, &out); err != nil || out.Published != int64(len(evs)) {
		t.Fatalf("dispatcher response %s (%v): want %d published", res.Response, err, len(evs))
	}

	// Read the stream back in its order.
	c, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	seq := map[string]int64{}
	seen := map[string]bool{}
	for range evs {
		m, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatalf("stream %s after %d messages: %v", stream, len(seen), err)
		}
		e, err := envelope.Decode(m.Data())
		if err != nil {
			t.Fatal(err)
		}
		if m.Headers().Get("Nats-Msg-Id") != e.ID || seen[e.ID] {
			t.Errorf("event %s: Nats-Msg-Id %q, seen before %v", e.ID, m.Headers().Get("Nats-Msg-Id"), seen[e.ID])
		}
		seen[e.ID] = true
		if e.Sequence <= seq[e.AggregateID] {
			t.Errorf("aggregate %s: sequence %d after %d", e.AggregateID, e.Sequence, seq[e.AggregateID])
		}
		seq[e.AggregateID] = e.Sequence
	}
	info, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != uint64(len(evs)) {
		t.Errorf("stream %s holds %d messages, want %d", stream, n, len(evs))
	}
}
