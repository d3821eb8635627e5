package amqp

import (
	"context"
	"errors"
	"fmt"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/transport"
)

// Provisioner declares a topology on the broker.
type Provisioner struct {
	cfg Config
}

var _ transport.Provisioner = (*Provisioner)(nil)

// NewProvisioner returns a Provisioner for cfg's topology.
func NewProvisioner(cfg Config) (*Provisioner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp provisioner: %w", err)
	}
	return &Provisioner{cfg: cfg}, nil
}

// ErrTopologyConflict is returned (wrapped) when an exchange or queue exists
// with other settings than the topology's (the broker's 406
// PRECONDITION_FAILED). Provision never deletes or changes what exists:
// delete the entity (after draining it) or keep its old settings.
var ErrTopologyConflict = errors.New("amqp: an existing exchange or queue has other settings than the topology")

// Provision declares, in order: under the alternate unrouted policy the
// alternate exchange "<exchange>.unrouted" (fanout) and its catch-all
// queue; the events exchange; the dead-letter
// exchange (direct); per consumer its queue (durable, single active
// consumer, dead-lettering to "<queue>.dlq", quorum or classic), the queue's
// bindings, its DLQ bound to the dead-letter exchange, and one delay queue
// per distinct retry delay (TTL, dead-lettering back to the queue through
// the default exchange), and the consumer's settle exchange bound to its
// retry queues and DLQ. Declaring what exists with the same settings changes
// nothing, so Provision is safe to run on every deploy or start. Then it
// creates or updates Config.Users through the management API.
//
// It does not remove bindings or queues the topology no longer lists: AMQP
// cannot list them (the management API can); remove them by hand.
func (p *Provisioner) Provision(ctx context.Context) error {
	conn, err := p.cfg.dial("provisioner")
	if err != nil {
		return fmt.Errorf("provision: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("provision: open channel: %w", err)
	}
	t := &p.cfg.Topology
	step := func(what string, err error) error {
		if err == nil {
			return ctx.Err()
		}
		var ae *amqp091.Error
		if errors.As(err, &ae) && ae.Code == amqp091.PreconditionFailed {
			return fmt.Errorf("provision %s: %w: %s", what, ErrTopologyConflict, ae.Reason)
		}
		return fmt.Errorf("provision %s: %w", what, err)
	}
	var exchangeArgs amqp091.Table
	if ae := t.AlternateExchange(); ae != "" {
		// The catch-all first: the events exchange names it. Changing the
		// policy of an existing events exchange is a conflict (RabbitMQ
		// compares alternate-exchange on redeclaration).
		if err := step("alternate exchange "+ae, ch.ExchangeDeclare(ae, KindFanout, true, false, false, false, nil)); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(t.Unrouted.Queue, true, false, false, false, t.dlqArgs()); err != nil {
			return step("queue "+t.Unrouted.Queue, err)
		}
		if err := step("binding "+ae+" -> "+t.Unrouted.Queue, ch.QueueBind(t.Unrouted.Queue, "", ae, false, nil)); err != nil {
			return err
		}
		exchangeArgs = amqp091.Table{"alternate-exchange": ae}
	}
	if err := step("exchange "+t.Exchange.Name, ch.ExchangeDeclare(t.Exchange.Name, t.Exchange.Kind, true, false, false, false, exchangeArgs)); err != nil {
		return err
	}
	if err := step("dead-letter exchange "+t.DeadLetterExchange, ch.ExchangeDeclare(t.DeadLetterExchange, KindDirect, true, false, false, false, nil)); err != nil {
		return err
	}
	for _, c := range t.Consumers {
		q := c.QueueName()
		if _, err := ch.QueueDeclare(q, true, false, false, false, t.queueArgs(c)); err != nil {
			return step("queue "+q, err)
		}
		bindings := c.Bindings
		if t.Exchange.Kind == KindFanout {
			bindings = []Binding{{}}
		}
		for _, b := range bindings {
			var args amqp091.Table
			if t.Exchange.Kind == KindHeaders {
				args = amqp091.Table{"x-match": "all"}
				for k, v := range b.Headers {
					args[k] = v
				}
			}
			if err := step(fmt.Sprintf("binding %s -> %s (%q)", t.Exchange.Name, q, b.Key), ch.QueueBind(q, b.Key, t.Exchange.Name, false, args)); err != nil {
				return err
			}
		}
		if _, err := ch.QueueDeclare(c.DLQName(), true, false, false, false, t.dlqArgs()); err != nil {
			return step("queue "+c.DLQName(), err)
		}
		if err := step("binding "+t.DeadLetterExchange+" -> "+c.DLQName(), ch.QueueBind(c.DLQName(), c.DLQName(), t.DeadLetterExchange, false, nil)); err != nil {
			return err
		}
		settle := c.SettleExchange()
		if err := step("settle exchange "+settle, ch.ExchangeDeclare(settle, KindDirect, true, false, false, false, nil)); err != nil {
			return err
		}
		if err := step("binding "+settle+" -> "+c.DLQName(), ch.QueueBind(c.DLQName(), c.DLQName(), settle, false, nil)); err != nil {
			return err
		}
		for _, rq := range c.RetryQueues() {
			if _, err := ch.QueueDeclare(rq.Name, true, false, false, false, t.retryQueueArgs(c, rq.Delay)); err != nil {
				return step("queue "+rq.Name, err)
			}
			if err := step("binding "+settle+" -> "+rq.Name, ch.QueueBind(rq.Name, rq.Name, settle, false, nil)); err != nil {
				return err
			}
		}
	}
	p.cfg.Logger.Info("amqp: topology provisioned", "exchange", t.Exchange.Name, "consumers", len(t.Consumers))
	if err := ch.Close(); err != nil {
		return fmt.Errorf("provision: %w", err)
	}
	if len(p.cfg.Users) > 0 {
		return p.provisionUsers(ctx)
	}
	return nil
}
