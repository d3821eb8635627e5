package amqp

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"

	"github.com/aws/aws-lambda-go/events"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// LambdaHandler is the consumer Lambda for Amazon MQ for RabbitMQ.
//
// Lambda's Amazon MQ event source has no partial batch response: a returned
// error makes Lambda deliver the whole batch again (under its own redelivery
// policy, which cannot be configured), and success acknowledges all of it.
// So the handler settles every record itself before returning: applied and
// duplicate records need nothing; a transient failure is sent to the
// consumer's delay queue (and its aggregate parked, as in the Runner); an
// invalid or permanently failing record is sent to the DLQ with the reason.
// Those sends are publisher-confirmed. One bad record therefore neither
// blocks the others (they are applied, and the batch succeeds) nor re-applies
// them. Only when a send itself fails does Handle return an error; Lambda
// then redelivers the batch, the inbox drops the records already applied,
// and the remaining records of a failed aggregate were left unapplied so
// that they keep their order.
//
// What Lambda does with a batch once its own redelivery policy is used up
// is Lambda's (AWS documents a fixed policy, maximumRedeliveries 6); the
// queue dead-letters whatever the broker rejects or, for a quorum queue,
// delivers DeliveryLimit times, to the consumer's DLQ, so such records end
// there rather than being lost.
type LambdaHandler struct {
	cfg Config
	s   *settler
	out *sender

	mu sync.Mutex // one invocation at a time per environment; guards parking
}

// NewLambdaHandler returns the handler for cc.Consumer. It opens its
// publishing connection (for delay queue and DLQ sends) lazily and keeps it
// across invocations.
func NewLambdaHandler(cfg Config, db inbox.DB, apply inbox.Apply, cc ConsumerConfig) (*LambdaHandler, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp lambda handler: %w", err)
	}
	h := &LambdaHandler{cfg: cfg}
	h.out = newSender(&h.cfg, "lambda/"+cc.Consumer)
	s, err := newSettler(&h.cfg, db, apply, cc, h.out)
	if err != nil {
		return nil, fmt.Errorf("new amqp lambda handler: %w", err)
	}
	h.s = s
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
	var firstErr error
	for _, k := range queues {
		q, _, _ := strings.Cut(k, "::") // "queue::vhost"
		if q != h.s.c.QueueName() {
			return fmt.Errorf("amqp lambda: records from queue %q, but consumer %s reads %q: check the event source mapping", q, h.s.c.Name, h.s.c.QueueName())
		}
		if err := h.batch(ctx, ev.MessagesByQueue[k]); err != nil && firstErr == nil {
			firstErr = err
		}
	}
	return firstErr
}

func (h *LambdaHandler) batch(ctx context.Context, msgs []events.RabbitMQMessage) error {
	lanes := transport.NewLanes(h.s.c.Workers, len(msgs))
	batches := h.s.newBatcher(lanes)
	var mu sync.Mutex
	var firstErr error
	for i, m := range msgs {
		d, err := fromLambda(m)
		if err != nil {
			// Not even the envelope could be read (bad base64): treat as invalid.
			d = &delivery{messageID: fmt.Sprintf("record-%d", i), headers: amqp091.Table{}, decodeErr: err}
		}
		// Lambda settles the records when the function returns nil:
		// nothing to acknowledge one by one.
		_ = batches.submit(context.WithoutCancel(ctx), d, func() error { return nil }, func(err error) {
			if errors.Is(err, errPoisoned) {
				return
			}
			mu.Lock()
			if firstErr == nil {
				firstErr = err
			}
			mu.Unlock()
		})
	}
	lanes.Close()
	if firstErr != nil {
		return fmt.Errorf("amqp lambda: a record could not be settled; failing the batch so Lambda delivers it again (applied records are skipped by the inbox): %w", firstErr)
	}
	return nil
}

// fromLambda converts a Lambda record: base64 data, and headers whose string
// values arrive as {"bytes": [...]}.
func fromLambda(m events.RabbitMQMessage) (*delivery, error) {
	body, err := base64.StdEncoding.DecodeString(m.Data)
	if err != nil {
		return nil, fmt.Errorf("record data is not base64: %w", err)
	}
	bp := m.BasicProperties
	d := &delivery{body: body, headers: amqp091.Table{}, props: amqp091.Publishing{
		ContentType: bp.ContentType, DeliveryMode: bp.DeliveryMode, Priority: bp.Priority,
		MessageId: deref(bp.MessageID), Type: deref(bp.Type), AppId: deref(bp.AppID), CorrelationId: deref(bp.CorrelationID),
	}}
	d.messageID = d.props.MessageId
	for k, v := range bp.Headers {
		d.headers[k] = lambdaHeader(v)
	}
	d.decode()
	return d, nil
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
