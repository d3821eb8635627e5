package sns_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

func oneConsumer(maxReceive int) topology.Topology {
	return topology.Topology{
		Topic: topology.Topic{Name: "events.fifo", ThroughputScope: "MessageGroup"},
		Consumers: []topology.Consumer{{Name: "c", MaxReceiveCount: maxReceive, FunctionTimeoutSeconds: 1,
			VisibilityTimeoutSeconds: 6, MaxConcurrency: 2}},
	}
}

// consumerSetup gives a test its own schema, its own one-consumer topology
// ("c", maxReceiveCount maxReceive, visibility timeout 6s) on the emulator,
// and the inbox handler (testApply) for that consumer.
func consumerSetup(t *testing.T, maxReceive int, order inbox.Order) (*pgtest.DB, *emulatortest.Env, sns.Queue, *sns.Handler) {
	t.Helper()
	db := newDB(t)
	env := emulatortest.New(t, oneConsumer(maxReceive), 6)
	q := env.Queues["c"]
	h, err := sns.NewHandler(db.Pool, env.SQS, testApply, sns.HandlerConfig{Consumer: "c", DLQURL: q.DLQURL, Order: order})
	if err != nil {
		t.Fatal(err)
	}
	return db, env, q, h
}

func publish(t *testing.T, env *emulatortest.Env, evs ...envelope.Envelope) {
	t.Helper()
	pub, err := sns.NewPublisher(env.SNS, sns.PublisherConfig{TopicARN: env.TopicARN})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []outbox.Message
	for _, e := range evs {
		b, _ := e.Encode()
		msgs = append(msgs, outbox.Message{EventID: e.ID, GroupID: e.AggregateID, Sequence: e.Sequence, Body: b, Attributes: e.Attributes()})
	}
	for i, err := range pub.Publish(context.Background(), msgs) {
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
}

func receiveAll(t *testing.T, c *sqs.Client, url string, want int, within time.Duration) []sqstypes.Message {
	t.Helper()
	var got []sqstypes.Message
	deadline := time.Now().Add(within)
	for len(got) < want && time.Now().Before(deadline) {
		out, err := c.ReceiveMessage(context.Background(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
			MessageAttributeNames: []string{"All"}, MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameAll}})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, out.Messages...)
	}
	return got
}

func runUntil(t *testing.T, r *sns.Runner, done func() bool, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !done() {
		if time.Now().After(deadline) {
			t.Fatal("runner: condition not reached in time")
		}
		if _, err := r.Poll(context.Background(), 1); err != nil {
			t.Fatal(err)
		}
	}
}

// A poison message (always failing transiently) moves to the DLQ after
// maxReceiveCount receives; then, in relaxed order, its group continues.
// Other groups are never held up.
func TestPoisonMessageMovesToDLQAndGroupContinues(t *testing.T) {
	t.Parallel()
	db, env, q, h := consumerSetup(t, 3, inbox.OrderRelaxed)
	// X/1 always fails transiently (see testApply).
	poison, x2, x3, y1, y2 := ev("X", 1), ev("X", 2), ev("X", 3), ev("Y", 1), ev("Y", 2)
	publish(t, env, poison, y1)
	publish(t, env, x2, y2)
	publish(t, env, x3)
	r := &sns.Runner{SQS: env.SQS, QueueURL: q.URL, QueueARN: q.ARN, Handler: h.Handle, RetryDelay: time.Second}
	runUntil(t, r, func() bool {
		return countEffects(t, db, x3.ID) == 1 && countEffects(t, db, y2.ID) == 1
	}, time.Minute)
	for _, e := range []envelope.Envelope{x2, x3, y1, y2} {
		if n := countEffects(t, db, e.ID); n != 1 {
			t.Fatalf("event %s/%d applied %d times", e.AggregateID, e.Sequence, n)
		}
	}
	if countEffects(t, db, poison.ID) != 0 {
		t.Fatal("poison message applied")
	}
	dead := receiveAll(t, env.SQS, q.DLQURL, 1, 10*time.Second)
	if len(dead) != 1 {
		t.Fatalf("DLQ holds %d messages, want the poison one", len(dead))
	}
	got, err := envelope.Decode([]byte(aws.ToString(dead[0].Body)))
	if err != nil || got.ID != poison.ID {
		t.Fatalf("DLQ message %v (%v), want the poison event", got.ID, err)
	}
	// And nothing else is left in the queue.
	if left := receiveAll(t, env.SQS, q.URL, 1, 2*time.Second); len(left) != 0 {
		t.Fatalf("%d messages left in the queue", len(left))
	}
}

// An invalid envelope goes to the DLQ at once, with the reason (relaxed
// order: the group continues past it).
func TestInvalidEnvelopeToDLQAtOnce(t *testing.T) {
	t.Parallel()
	db, env, q, h := consumerSetup(t, 5, inbox.OrderRelaxed)
	good := ev("I", 2)
	b, _ := good.Encode()
	for i, body := range []string{`{"v":1,"id":"not-a-uuid"}`, string(b)} {
		if _, err := env.SQS.SendMessage(context.Background(), &sqs.SendMessageInput{QueueUrl: aws.String(q.URL), MessageBody: aws.String(body),
			MessageGroupId: aws.String("I"), MessageDeduplicationId: aws.String(fmt.Sprintf("d%d", i))}); err != nil {
			t.Fatal(err)
		}
	}
	r := &sns.Runner{SQS: env.SQS, QueueURL: q.URL, QueueARN: q.ARN, Handler: h.Handle}
	runUntil(t, r, func() bool { return countEffects(t, db, good.ID) == 1 }, 30*time.Second)
	dead := receiveAll(t, env.SQS, q.DLQURL, 1, 10*time.Second)
	if len(dead) != 1 {
		t.Fatalf("DLQ holds %d, want 1", len(dead))
	}
	m := dead[0]
	if c := aws.ToString(m.MessageAttributes[sns.AttrErrorClass].StringValue); c != inbox.ClassInvalid {
		t.Fatalf("error class %q", c)
	}
	if reason := aws.ToString(m.MessageAttributes[sns.AttrErrorReason].StringValue); reason == "" || m.Attributes["ApproximateReceiveCount"] == "" {
		t.Fatalf("reason %q attrs %v", reason, m.Attributes)
	}
	if m.Attributes["MessageGroupId"] != "I" {
		t.Fatalf("DLQ group %q, want the original I", m.Attributes["MessageGroupId"])
	}
}

// Outbox -> dispatcher -> SNS -> SQS -> runner -> handler -> read model, with
// duplicate deliveries injected (records repeated within batches, and
// messages sent to the queue again after they were processed): every event
// is applied once, in order per aggregate.
func TestEndToEndThroughConsumerWithDuplicates(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	topo := topology.Default()
	env := emulatortest.New(t, topo, 6)
	q := env.Queues["orders-projection"]
	h, err := sns.NewHandler(db.Pool, env.SQS, readmodel.Apply, sns.HandlerConfig{Consumer: "orders-projection", DLQURL: q.DLQURL})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	dups := 0
	// Inject duplicates: repeat random records in the batch, and re-send
	// some processed messages to the queue (a redelivery after ack).
	handler := func(ctx context.Context, e events.SQSEvent) (events.SQSEventResponse, error) {
		var recs []events.SQSMessage
		for _, r := range e.Records {
			recs = append(recs, r)
			if rand.IntN(5) == 0 {
				d := r
				d.MessageId = r.MessageId + "-dup"
				recs = append(recs, d)
				mu.Lock()
				dups++
				mu.Unlock()
			}
		}
		resp, err := h.Handle(ctx, events.SQSEvent{Records: recs})
		for i := range resp.BatchItemFailures {
			if id := resp.BatchItemFailures[i].ItemIdentifier; len(id) > 4 && id[len(id)-4:] == "-dup" {
				resp.BatchItemFailures[i].ItemIdentifier = id[:len(id)-4]
			}
		}
		for _, r := range e.Records {
			if rand.IntN(10) == 0 {
				_, _ = env.SQS.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(q.URL), MessageBody: aws.String(r.Body),
					MessageGroupId: aws.String(r.Attributes["MessageGroupId"]), MessageDeduplicationId: aws.String("redeliver-" + r.MessageId)})
				mu.Lock()
				dups++
				mu.Unlock()
			}
		}
		return resp, err
	}
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	var rwg sync.WaitGroup
	for i := 0; i < 2; i++ { // two concurrent "Lambda instances"
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			_ = (&sns.Runner{SQS: env.SQS, QueueURL: q.URL, QueueARN: q.ARN, Handler: handler}).Run(rctx)
		}()
	}
	pub, _ := sns.NewPublisher(env.SNS, sns.PublisherConfig{TopicARN: env.TopicARN})
	d, _ := outbox.NewDispatcher(db.Pool, pub, outbox.DispatcherConfig{})
	var dwg sync.WaitGroup
	dwg.Add(1)
	go func() { defer dwg.Done(); _ = d.Run(rctx) }()

	const orders = 60
	steps := []string{"order.created", "order.paid", "order.shipped"}
	for s, typ := range steps {
		for o := 0; o < orders; o++ {
			id := fmt.Sprintf("o-%03d", o)
			e, _ := envelope.New(typ, "order", id, readmodel.OrderEvent{OrderID: id, CustomerID: "c", AmountCents: int64(100 * (o + 1)), Currency: "EUR"})
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }); err != nil {
				t.Fatal(err)
			}
		}
		_ = s
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		var shipped int
		_ = db.Pool.QueryRow(ctx, "SELECT count(*) FROM orders_read_model WHERE status = 'shipped'").Scan(&shipped)
		if shipped == orders || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(time.Second) // late duplicates
	stop()
	rwg.Wait()
	dwg.Wait()
	rows, _ := db.Pool.Query(ctx, "SELECT order_id, status, event_count, last_sequence, amount_cents FROM orders_read_model ORDER BY order_id")
	type row struct {
		id, status  string
		count       int
		seq, amount int64
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.id, &x.status, &x.count, &x.seq, &x.amount)
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != orders {
		t.Fatalf("%d orders in the read model, want %d", len(got), orders)
	}
	for i, r := range got {
		if r.status != "shipped" || r.count != 3 || r.seq != 3 || r.amount != int64(100*(i+1)) {
			t.Fatalf("order %s: %+v; want shipped, 3 events applied once each, last sequence 3", r.id, r)
		}
	}
	var inboxRows int
	_ = db.Pool.QueryRow(ctx, "SELECT count(*) FROM inbox WHERE consumer = 'orders-projection'").Scan(&inboxRows)
	if inboxRows != orders*3 {
		t.Fatalf("inbox rows %d, want %d", inboxRows, orders*3)
	}
	t.Logf("%d events applied exactly once in order despite %d injected duplicate deliveries", orders*3, dups)
	if dups == 0 {
		t.Fatal("no duplicates injected")
	}
}

// Stopping the runner while a batch is being handled lets the batch finish
// with its own deadline, as a started Lambda invocation does: the records
// are applied and deleted, not failed and left in flight.
func TestRunnerFinishesTheBatchInHandWhenStopped(t *testing.T) {
	t.Parallel()
	db, env, q, h := consumerSetup(t, 5, inbox.OrderStrict)
	e1, e2 := ev("S", 1), ev("S", 2)
	publish(t, env, e1, e2)
	ctx, stop := context.WithCancel(context.Background())
	var handled sync.Once
	handler := func(hctx context.Context, batch events.SQSEvent) (events.SQSEventResponse, error) {
		// Stop the runner mid-batch, then handle the batch.
		handled.Do(stop)
		<-ctx.Done()
		if err := hctx.Err(); err != nil {
			t.Errorf("handler context done after the runner was stopped: %v", err)
		}
		return h.Handle(hctx, batch)
	}
	r := &sns.Runner{SQS: env.SQS, QueueURL: q.URL, QueueARN: q.ARN, Handler: handler, HandlerTimeout: 10 * time.Second}
	if err := r.Run(ctx); err != nil {
		t.Fatal(err)
	}
	applied := countEffects(t, db, e1.ID) + countEffects(t, db, e2.ID)
	if applied == 0 {
		t.Fatal("the batch in hand was not applied")
	}
	// What was handled is deleted: past the visibility timeout (6s) nothing
	// comes back except events the batch did not hold (FIFO may hand over
	// one group's messages in more than one batch).
	// receiveAll leaves what it receives in flight, so a message it gets
	// twice (after the visibility timeout) counts once.
	left := map[string]bool{}
	for _, m := range receiveAll(t, env.SQS, q.URL, 3, 8*time.Second) {
		got, _ := envelope.Decode([]byte(aws.ToString(m.Body)))
		if countEffects(t, db, got.ID) != 0 {
			t.Fatalf("event %d was applied and is still in the queue", got.Sequence)
		}
		left[got.ID] = true
	}
	if len(left)+applied != 2 {
		t.Fatalf("%d applied, %d back in the queue; want the 2 events exactly once between them", applied, len(left))
	}
}
