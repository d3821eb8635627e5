package sns_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

var orderFlow = []string{"order.created", "order.paid", "order.shipped", "order.updated"}

// makeEvent returns the n-th event (0-based) of an aggregate.
func makeEvent(aggType, aggID string, n int) envelope.Envelope {
	id, _ := uuid.NewV7()
	typ := "customer.updated"
	if aggType == "order" {
		typ = orderFlow[n%len(orderFlow)]
	}
	return envelope.Envelope{
		ID: id.String(), Type: typ, OccurredAt: time.Now().UTC(), AggregateType: aggType, AggregateID: aggID,
		TenantID: "acme", SchemaVersion: 1, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, n)),
	}
}

type received struct {
	EventID, AggregateID, Type string
	Sequence                   int64
	GroupID                    string
}

// drainQueue receives and deletes until ctx ends, reporting each message.
func drainQueue(ctx context.Context, t *testing.T, c *sqs.Client, url string, got func(received)) {
	for ctx.Err() == nil {
		out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
			MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameAll},
		})
		if err != nil {
			if ctx.Err() == nil {
				time.Sleep(50 * time.Millisecond) // emulator restarting
			}
			continue
		}
		var del []sqstypes.DeleteMessageBatchRequestEntry
		for i, m := range out.Messages {
			e, err := envelope.Decode([]byte(aws.ToString(m.Body)))
			if err != nil {
				t.Errorf("queue message is not an envelope: %v", err)
				continue
			}
			got(received{EventID: e.ID, AggregateID: e.AggregateID, Type: e.Type, Sequence: e.Sequence, GroupID: m.Attributes["MessageGroupId"]})
			del = append(del, sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String(fmt.Sprint(i)), ReceiptHandle: m.ReceiptHandle})
		}
		if len(del) > 0 {
			_, _ = c.DeleteMessageBatch(context.Background(), &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: del})
		}
	}
}

type pipeline struct {
	t        *testing.T
	db       *pgtest.DB
	env      *emulatortest.Env
	topo     topology.Topology
	mu       sync.Mutex
	expected map[string]map[string]bool // consumer -> event ids it should get
	got      map[string][]received
}

func newPipeline(t *testing.T, env *emulatortest.Env, topo topology.Topology) *pipeline {
	p := &pipeline{t: t, db: pgtest.New(t), env: env, topo: topo, expected: map[string]map[string]bool{}, got: map[string][]received{}}
	for _, c := range topo.Consumers {
		p.expected[c.Name] = map[string]bool{}
	}
	return p
}

func (p *pipeline) enqueue(evs ...envelope.Envelope) {
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, p.db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) }); err != nil {
		p.t.Errorf("enqueue: %v", err)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range evs {
		for _, c := range p.topo.Consumers {
			if c.Matches(e.Attributes()) {
				p.expected[c.Name][e.ID] = true
			}
		}
	}
}

func (p *pipeline) startReceivers(ctx context.Context) *sync.WaitGroup {
	var wg sync.WaitGroup
	for _, c := range p.topo.Consumers {
		name := c.Name
		url := p.env.Queues[name].URL
		for w := 0; w < 2; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				drainQueue(ctx, p.t, p.env.SQS, url, func(r received) {
					p.mu.Lock()
					p.got[name] = append(p.got[name], r)
					p.mu.Unlock()
				})
			}()
		}
	}
	return &wg
}

func (p *pipeline) complete() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name, exp := range p.expected {
		if len(p.got[name]) < len(exp) {
			return false
		}
	}
	return true
}

// check asserts every queue got exactly its events, once each, in
// per-aggregate sequence order, with the aggregate id as group id.
func (p *pipeline) check() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name, exp := range p.expected {
		seen := map[string]bool{}
		last := map[string]int64{}
		for _, r := range p.got[name] {
			if seen[r.EventID] {
				p.t.Errorf("%s: event %s delivered twice", name, r.EventID)
			}
			seen[r.EventID] = true
			if !exp[r.EventID] {
				p.t.Errorf("%s: got event %s (%s) its filter does not select", name, r.EventID, r.Type)
			}
			if r.Sequence <= last[r.AggregateID] {
				p.t.Errorf("%s: aggregate %s: sequence %d after %d", name, r.AggregateID, r.Sequence, last[r.AggregateID])
			}
			last[r.AggregateID] = r.Sequence
			if r.GroupID != r.AggregateID {
				p.t.Errorf("%s: group id %q, want aggregate id %q", name, r.GroupID, r.AggregateID)
			}
		}
		if len(seen) != len(exp) {
			p.t.Errorf("%s: got %d distinct events, want %d", name, len(seen), len(exp))
		}
		p.t.Logf("%s: %d events, each once, in order", name, len(seen))
	}
}

func startDispatcher(t *testing.T, ctx context.Context, db *pgtest.DB, pub outbox.Publisher, cfg outbox.DispatcherConfig) (*outbox.Dispatcher, *sync.WaitGroup) {
	d, err := outbox.NewDispatcher(db.Pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	return d, &wg
}

// produce enqueues total events over aggregates (3/4 orders, 1/4 customers)
// in transactions of 1-5 events, from 4 producers.
func produce(p *pipeline, total, aggregates int, pace time.Duration) {
	var mu sync.Mutex
	next := map[string]int{}
	made := 0
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				if made >= total {
					mu.Unlock()
					return
				}
				n := min(1+rand.IntN(5), total-made)
				made += n
				a := rand.IntN(aggregates)
				typ := "order"
				if a%4 == 3 {
					typ = "customer"
				}
				id := fmt.Sprintf("%s-%03d", typ, a)
				evs := make([]envelope.Envelope, n)
				for i := range evs {
					evs[i] = makeEvent(typ, id, next[id])
					next[id]++
				}
				mu.Unlock()
				p.enqueue(evs...)
				if pace > 0 {
					time.Sleep(pace)
				}
			}
		}()
	}
	wg.Wait()
}

func TestEndToEndThroughEmulator(t *testing.T) {
	t.Parallel()
	topo := topology.Default()
	env := emulatortest.New(t, topo, 30)
	p := newPipeline(t, env, topo)
	pub, err := sns.NewPublisher(env.SNS, sns.PublisherConfig{TopicARN: env.TopicARN})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, dwg := startDispatcher(t, ctx, p.db, pub, outbox.DispatcherConfig{BackoffBase: 50 * time.Millisecond, BackoffCap: time.Second})
	rwg := p.startReceivers(ctx)

	start := time.Now()
	produce(p, 5000, 200, 0)
	for !p.complete() && time.Since(start) < 2*time.Minute {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond) // anything extra (a duplicate) arrives now
	cancel()
	dwg.Wait()
	rwg.Wait()
	t.Logf("5000 events through PostgreSQL -> SNS FIFO -> 3 filtered SQS FIFO queues in %s", time.Since(start).Round(time.Millisecond))
	p.check()
	var notSent int
	_ = p.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox_events WHERE state <> 'sent'").Scan(&notSent)
	if notSent != 0 {
		t.Fatalf("%d outbox rows not sent", notSent)
	}
}

// checkAllowingRepeats is check for runs with an outage: a publish whose
// response was lost is retried, so an event may arrive again right after
// itself (never after a later event of its aggregate); none may be missing.
func (p *pipeline) checkAllowingRepeats() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name, exp := range p.expected {
		seen := map[string]bool{}
		last := map[string]int64{}
		repeats := 0
		for _, r := range p.got[name] {
			switch {
			case r.Sequence > last[r.AggregateID]:
				last[r.AggregateID] = r.Sequence
			case r.Sequence == last[r.AggregateID] && seen[r.EventID]:
				repeats++
			default:
				p.t.Errorf("%s: aggregate %s: sequence %d after %d", name, r.AggregateID, r.Sequence, last[r.AggregateID])
			}
			seen[r.EventID] = true
		}
		for id := range exp {
			if !seen[id] {
				p.t.Errorf("%s: event %s lost", name, id)
			}
		}
		if len(seen) != len(exp) {
			p.t.Errorf("%s: got %d distinct events, want %d", name, len(seen), len(exp))
		}
		p.t.Logf("%s: %d events, none lost, in order, %d repeated deliveries", name, len(seen), repeats)
	}
}
