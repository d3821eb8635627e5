package redrive_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// oneConsumer is a pipeline with a single consumer "c" (maxReceiveCount 2)
// whose side effect fails for the events in reject: transiently or
// permanently, until the test clears them.
type oneConsumer struct {
	db     *pgtest.DB
	env    *emulatortest.Env
	q      QueueURLsAndARN
	svc    *redrive.Service
	mu     sync.Mutex
	reject map[string]error
	attrs  map[string]map[string]string // event id -> message attributes the handler saw
}

type QueueURLsAndARN struct{ url, dlq, sub, arn string }

func newOneConsumer(t *testing.T, withDispatcher bool) *oneConsumer {
	t.Helper()
	p := &oneConsumer{db: pgtest.New(t), reject: map[string]error{}, attrs: map[string]map[string]string{}}
	topo := topology.Topology{Topic: topology.Topic{Name: "events.fifo", ThroughputScope: "MessageGroup"},
		Consumers: []topology.Consumer{{Name: "c", MaxReceiveCount: 2, FunctionTimeoutSeconds: 1, VisibilityTimeoutSeconds: 6, MaxConcurrency: 2}}}
	p.env = emulatortest.New(t, topo, 6)
	deleteSubscriptionDLQs(t, p.env)
	pq := p.env.Queues["c"]
	p.q = QueueURLsAndARN{url: pq.URL, dlq: pq.DLQURL, sub: pq.SubDLQURL, arn: pq.ARN}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	if _, err := p.db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial PRIMARY KEY, consumer text, event_id uuid, aggregate_id text, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		p.mu.Lock()
		err := p.reject[e.ID]
		p.mu.Unlock()
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_id, seq) VALUES ('c', $1, $2, $3)`, e.ID, e.AggregateID, e.Sequence)
		return err
	}
	h, err := sns.NewHandler(p.db.Pool, p.env.SQS, apply, sns.HandlerConfig{Consumer: "c", DLQURL: pq.DLQURL, MaxReceiveCount: 2, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	observe := func(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error) {
		for _, r := range ev.Records {
			if e, err := envelope.Decode([]byte(r.Body)); err == nil {
				a := map[string]string{}
				for k, v := range r.MessageAttributes {
					a[k] = aws.ToString(v.StringValue)
				}
				p.mu.Lock()
				p.attrs[e.ID] = a
				p.mu.Unlock()
			}
		}
		return h.Handle(ctx, ev)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = (&sns.Runner{SQS: p.env.SQS, QueueURL: pq.URL, QueueARN: pq.ARN, Handler: observe, RetryDelay: time.Second, Logger: quiet}).Run(ctx)
	}()
	if withDispatcher {
		pub, err := sns.NewPublisher(p.env.SNS, sns.PublisherConfig{TopicARN: p.env.TopicARN})
		if err != nil {
			t.Fatal(err)
		}
		d, err := outbox.NewDispatcher(p.db.Pool, pub, outbox.DispatcherConfig{PollInterval: 20 * time.Millisecond, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = d.Run(ctx) }()
	}
	p.svc, err = redrive.New(p.db.Pool, redrive.Config{Logger: quiet,
		Operations: snsOps(t, p.env, sns.Queues{"c": {QueueURL: pq.URL, DLQURL: pq.DLQURL, SubscriptionDLQURL: pq.SubDLQURL}}, &topo)})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *oneConsumer) applied(t *testing.T) int {
	t.Helper()
	var n int
	if err := p.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM applied`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (p *oneConsumer) until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (p *oneConsumer) status(t *testing.T) redrive.QueueDepth {
	t.Helper()
	st, err := p.svc.Execute(context.Background(), redrive.Command{Operation: redrive.OpStatus, Consumer: "c"})
	if err != nil || len(st.Status.Queues.Consumers) != 1 {
		t.Fatalf("status %+v %v", st, err)
	}
	return st.Status.Queues.Consumers[0]
}

// Strict order end to end (outbox -> dispatcher -> SNS -> SQS -> runner ->
// handler -> DLQ -> redrive): a/1 fails until its last receive
// (maxReceiveCount 2), b/2 fails permanently. The consumer never applies
// a/2, a/3 or b/3 before the event they follow; they wait in the DLQ behind
// it; c is untouched. After the fix, one redrive applies every event once,
// in order, and ends the holds.
func TestStrictOrderEndToEndThroughDLQAndRedrive(t *testing.T) {
	p := newOneConsumer(t, true)
	ctx := context.Background()
	var evs []envelope.Envelope
	for i := 0; i < 3; i++ {
		for _, agg := range []string{"a", "b", "c"} {
			evs = append(evs, event("thing", agg, "thing.changed"))
		}
	}
	p.mu.Lock()
	p.reject[evs[0].ID] = errors.New("database busy")                            // a/1: transient, every time
	p.reject[evs[4].ID] = envelope.Permanent(errors.New("cannot apply b/2 yet")) // b/2
	p.mu.Unlock()
	enqueue(t, p.db, evs...)
	p.until(t, "c applied, and the DLQ holding a/1-3 and b/2-3", func() bool {
		q := p.status(t)
		return p.applied(t) == 4 && q.DLQ == 5 && q.HeldGroups == 2 && q.HeldMessages == 5
	})
	time.Sleep(2 * time.Second) // nothing else may arrive
	if n := p.applied(t); n != 4 {
		t.Fatalf("%d events applied while a and b were held, want c/1-3 and b/1", n)
	}
	p.mu.Lock()
	p.reject = map[string]error{}
	p.mu.Unlock()
	res, err := p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: "c", Actor: "test"})
	if err != nil || res.Affected != 5 {
		t.Fatalf("redrive %+v %v", res, err)
	}
	p.until(t, "all 9 applied", func() bool { return p.applied(t) == 9 })
	time.Sleep(time.Second)
	if n := p.applied(t); n != 9 {
		t.Fatalf("%d applied, want 9 exactly once", n)
	}
	assertInOrder(t, p.db, "c")
	if q := p.status(t); q.HeldGroups != 0 || q.DLQ != 0 {
		t.Fatalf("after the redrive: %+v", q)
	}
}

// The subscription has a FIFO DLQ of its own (provision sets the
// RedrivePolicy; fauxqs ignores it, so the test puts there what SNS would),
// and dlq-redrive with source subscription-dlq moves its messages to the
// consumer's queue in group order: raw deliveries as they are without SNS's
// error attributes, notification JSON unwrapped to the published message.
func TestSubscriptionDLQRedrive(t *testing.T) {
	p := newOneConsumer(t, false)
	ctx := context.Background()
	subs, err := p.env.SNS.ListSubscriptionsByTopic(ctx, &snssvc.ListSubscriptionsByTopicInput{TopicArn: aws.String(p.env.TopicARN)})
	if err != nil || len(subs.Subscriptions) != 1 {
		t.Fatalf("subscriptions %+v %v", subs, err)
	}
	sa, err := p.env.SNS.GetSubscriptionAttributes(ctx, &snssvc.GetSubscriptionAttributesInput{SubscriptionArn: subs.Subscriptions[0].SubscriptionArn})
	if err != nil || !strings.Contains(sa.Attributes["RedrivePolicy"], p.env.Queues["c"].SubDLQARN) {
		t.Fatalf("subscription attributes %v (%v): want a RedrivePolicy to the subscription DLQ", sa.Attributes, err)
	}
	str := func(s string) sqstypes.MessageAttributeValue {
		return sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(s)}
	}
	var evs []envelope.Envelope
	for seq := int64(1); seq <= 4; seq++ {
		e := event("thing", "g", "thing.changed")
		e.Sequence = seq
		evs = append(evs, e)
		body, _ := e.Encode()
		in := &sqs.SendMessageInput{QueueUrl: aws.String(p.q.sub), MessageGroupId: aws.String("g"), MessageDeduplicationId: aws.String(e.ID)}
		if seq%2 == 1 { // raw delivery, with SNS's error attributes
			in.MessageBody = aws.String(string(body))
			in.MessageAttributes = map[string]sqstypes.MessageAttributeValue{"event_type": str(e.Type), "ErrorCode": str("KMS.DisabledException"),
				"ErrorMessage": str("key disabled"), "RequestID": str("r-1")}
		} else { // SNS notification JSON
			n, _ := json.Marshal(map[string]any{"Type": "Notification", "MessageId": fmt.Sprint("n", seq), "TopicArn": p.env.TopicARN,
				"Message": string(body), "MessageAttributes": map[string]any{"event_type": map[string]string{"Type": "String", "Value": e.Type}}})
			in.MessageBody = aws.String(string(n))
		}
		if _, err := p.env.SQS.SendMessage(ctx, in); err != nil {
			t.Fatal(err)
		}
	}
	if q := p.status(t); q.SubscriptionDLQ != 4 {
		t.Fatalf("status %+v, want 4 in the subscription DLQ", q)
	}
	res, err := p.svc.Execute(ctx, redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: "c", From: redrive.SourceSubscriptionDLQ, Actor: "test"})
	if err != nil || res.Affected != 4 {
		t.Fatalf("redrive %+v %v", res, err)
	}
	p.until(t, "4 applied", func() bool { return p.applied(t) == 4 })
	assertInOrder(t, p.db, "c")
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range evs {
		a := p.attrs[e.ID]
		if a["event_type"] != e.Type || a["ErrorCode"] != "" || a["RequestID"] != "" {
			t.Fatalf("event %d reached the consumer with attributes %v", e.Sequence, a)
		}
	}
}
