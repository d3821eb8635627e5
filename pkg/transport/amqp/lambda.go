package amqp

import (
	"context"
	"encoding/base64"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"

	"github.com/aws/aws-lambda-go/events"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/inbox"
)

// LambdaHandler is the consumer Lambda for Amazon MQ for RabbitMQ, on the
// same consumer engine (inbox.Engine) as the Runner.
//
// Lambda's Amazon MQ event source has no partial batch response: a returned
// error makes Lambda deliver the whole batch again (under its own fixed
// redelivery policy, maximumRedeliveries 6, after which the broker
// dead-letters the messages, bypassing fifobox's holds), and success
// acknowledges all of it. So the handler settles every record itself before
// returning: applied and duplicate records need nothing; a transient
// failure goes to the consumer's delay queue with its group parked in the
// database behind it (inbox_parked, so the group's later records follow it
// there, across invocations and environment recycles); an invalid or
// permanently failing record, or one out of retries, goes to the DLQ with
// the reason, holding its group in strict order (inbox_held). Those sends
// are publisher-confirmed. One bad record therefore neither blocks the
// others nor re-applies them.
//
// The deadline: "redeliver only what was not finished" means, on this event
// source, that the handler hands those records back itself. It starts no
// record once the invocation's deadline is within DeadlineMargin; the
// records not started go to the first delay queue (no failure counted),
// each group parked behind its first such record, so they come back in
// order and nothing newer of their groups overtakes them, and the
// invocation succeeds before its timeout. Only when even that cannot be
// done (the broker refuses the copies, or the database is unreachable for
// the parking) does Handle return an error, and Lambda redelivers the
// batch: the inbox, the parks and the holds recognise what was done.
type LambdaHandler struct {
	cfg    Config
	engine *inbox.Engine
	c      Consumer
	out    *sender

	mu sync.Mutex // one invocation at a time per environment
}

// NewLambdaHandler returns the handler for cc.Consumer. It opens its
// publishing connection (for delay queue and DLQ sends) lazily and keeps it
// across invocations.
func NewLambdaHandler(cfg Config, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (*LambdaHandler, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp lambda handler: %w", err)
	}
	h := &LambdaHandler{cfg: cfg}
	e, c, err := newEngine(&h.cfg, db, apply, cc)
	if err != nil {
		return nil, fmt.Errorf("new amqp lambda handler: %w", err)
	}
	h.engine, h.c = e, c
	h.out = newSender(&h.cfg, "lambda/"+c.Name)
	return h, nil
}

// Close closes the publishing connection.
func (h *LambdaHandler) Close() error { return h.out.close() }

// Handle processes one invocation's batch.
func (h *LambdaHandler) Handle(ctx context.Context, ev events.RabbitMQEvent) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	queues := make([]string, 0, len(ev.MessagesByQueue))
	for k := range ev.MessagesByQueue {
		queues = append(queues, k)
	}
	sort.Strings(queues)
	var recs []*inbox.Record
	for _, k := range queues {
		q, _, _ := strings.Cut(k, "::") // "queue::vhost"
		if q != h.c.QueueName() {
			return fmt.Errorf("amqp lambda: records from queue %q, but consumer %s reads %q: check the event source mapping", q, h.c.Name, h.c.QueueName())
		}
		for i, m := range ev.MessagesByQueue[k] {
			d, body, err := fromLambda(m)
			if err != nil {
				// Not even the envelope could be read (bad base64): invalid.
				d, body = &delivery{messageID: fmt.Sprintf("record-%d", i), headers: amqp091.Table{}}, []byte(m.Data)
			}
			if d.messageID == "" {
				d.messageID = fmt.Sprintf("record-%d", i)
			}
			deliveries := 1
			if m.Redelivered {
				deliveries = 0
			}
			recs = append(recs, h.cfg.Topology.record(h.c, d, body, deliveries, m.Redelivered))
		}
	}
	if err := h.engine.Handle(ctx, &broker{topo: &h.cfg.Topology, c: h.c, out: h.out, cfg: &h.cfg}, recs); err != nil {
		return fmt.Errorf("amqp lambda: a record could not be settled; failing the batch so Lambda delivers it again (what was done is recognised): %w", err)
	}
	return nil
}

// fromLambda converts a Lambda record: base64 data, and headers whose string
// values arrive as {"bytes": [...]}.
func fromLambda(m events.RabbitMQMessage) (*delivery, []byte, error) {
	body, err := base64.StdEncoding.DecodeString(m.Data)
	if err != nil {
		return nil, nil, fmt.Errorf("record data is not base64: %w", err)
	}
	bp := m.BasicProperties
	d := &delivery{headers: amqp091.Table{}, props: amqp091.Publishing{
		ContentType: bp.ContentType, DeliveryMode: bp.DeliveryMode, Priority: bp.Priority,
		MessageId: deref(bp.MessageID), Type: deref(bp.Type), AppId: deref(bp.AppID), CorrelationId: deref(bp.CorrelationID),
	}}
	d.messageID = d.props.MessageId
	for k, v := range bp.Headers {
		d.headers[k] = lambdaHeader(v)
	}
	return d, body, nil
}

// lambdaHeader maps a header value from Lambda's JSON to an AMQP table value.
func lambdaHeader(v any) any {
	switch x := v.(type) {
	case map[string]any:
		if b, ok := x["bytes"].([]any); ok {
			out := make([]byte, 0, len(b))
			for _, e := range b {
				if f, ok := e.(float64); ok {
					out = append(out, byte(f))
				}
			}
			return string(out)
		}
		t := amqp091.Table{}
		for k, e := range x {
			t[k] = lambdaHeader(e)
		}
		return t
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = lambdaHeader(e)
		}
		return out
	case float64:
		if x == math.Trunc(x) && math.Abs(x) < 1<<53 {
			return int64(x)
		}
		return x
	}
	return v
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
