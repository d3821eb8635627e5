package amqp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp/internal/mgmtapi"
	"github.com/fifobox/fifobox/pkg/wire"
)

// This file is RabbitMQ's side of wire profiles (pkg/wire): a publisher
// with Config.Wire set publishes each event as the profile renders it, and
// ProfileProvisioner declares the profile's exchanges and queues exactly as
// the profile gives them, with the policies AMQP itself cannot set.

// EnvPolicies chooses how ProfileProvisioner sets policies.
const EnvPolicies = "FIFOBOX_AMQP_POLICIES"

// ProfileEnv declares the variables ProfileFromEnv reads.
var ProfileEnv = envspec.Join(wire.Env, envspec.Set{
	{Name: EnvPolicies, Doc: "how a profile's queue policies are set: management (default; the management API at http://<host>:15672, or https://<host> for amqps), management:<url>, or rabbitmqctl (a local broker)"},
})

// wireMessage renders m through the profile: its exchange, routing key,
// body, headers and properties.
func (p *Publisher) wireMessage(m *outbox.Message) (outgoing, error) {
	w, err := p.cfg.Wire.Render(m)
	if err != nil {
		return outgoing{}, envelope.Permanent(err)
	}
	if len(w.Body) > p.cfg.MaxMessageBytes {
		return outgoing{}, envelope.Permanent(fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, len(w.Body), p.cfg.MaxMessageBytes))
	}
	if len(w.Destination) > 255 {
		return outgoing{}, envelope.Permanent(fmt.Errorf("%w: %d bytes", ErrRoutingKey, len(w.Destination)))
	}
	h := make(amqp091.Table, len(w.Headers))
	for _, x := range w.Headers {
		h[x.Name] = x.Value
	}
	return outgoing{exchange: p.cfg.Wire.Profile().RabbitMQ.Exchange, key: w.Destination, msg: amqp091.Publishing{
		Headers:      h,
		ContentType:  w.ContentType,
		DeliveryMode: amqp091.Persistent,
		MessageId:    w.MessageID,
		Type:         w.Type,
		Timestamp:    w.Timestamp,
		AppId:        "fifobox",
		Body:         w.Body,
	}}, nil
}

// PolicySetter sets and reads RabbitMQ policies, which AMQP cannot.
type PolicySetter interface {
	// SetPolicies creates or replaces each policy on vhost.
	SetPolicies(ctx context.Context, vhost string, ps []Policy) error
	// QueuePolicies maps each queue of vhost to the policy it follows now
	// ("" for none).
	QueuePolicies(ctx context.Context, vhost string) (map[string]string, error)
}

// Policy is one queue policy.
type Policy struct {
	Name       string
	Pattern    string
	Definition map[string]any
	Priority   int
}

// ProfileProvisioner declares a profile's RabbitMQ entities: every
// exchange, then every queue with exactly its arguments, its bindings,
// and for a queue with a policy the policy (pattern ^queue$), checked to
// be the one the queue follows. Declaring what exists with the same
// settings changes nothing; an existing entity with other settings is
// ErrTopologyConflict naming it, and nothing is changed or deleted.
type ProfileProvisioner struct {
	cfg      Config
	policies PolicySetter
	// PolicyWait bounds the wait for every queue to follow its policy.
	// Default 30s.
	PolicyWait time.Duration
}

var _ transport.Provisioner = (*ProfileProvisioner)(nil)

// NewProfileProvisioner returns a provisioner for cfg.Wire's profile.
// policies may be nil when no queue of the profile has a policy.
func NewProfileProvisioner(cfg Config, policies PolicySetter) (*ProfileProvisioner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp profile provisioner: %w", err)
	}
	if cfg.Wire == nil {
		return nil, errors.New("new amqp profile provisioner: Config.Wire is not set")
	}
	r := cfg.Wire.Profile().RabbitMQ
	for i, q := range r.Queues {
		if len(q.Policy) > 0 && policies == nil {
			return nil, fmt.Errorf("profile %s: rabbitmq.queues[%d].policy: setting a policy needs the management API or rabbitmqctl (%s)",
				cfg.Wire.Profile().Name, i, EnvPolicies)
		}
	}
	return &ProfileProvisioner{cfg: cfg, policies: policies}, nil
}

// Provision implements transport.Provisioner.
func (p *ProfileProvisioner) Provision(ctx context.Context) error {
	prof := p.cfg.Wire.Profile()
	r := prof.RabbitMQ
	conn, err := p.cfg.dial("provisioner")
	if err != nil {
		return fmt.Errorf("provision profile %s: %w", prof.Name, err)
	}
	defer conn.Close()
	// A failed declare closes the channel: each step gets a fresh one when
	// the last failed, so the error names the entity and nothing else.
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("provision profile %s: open channel: %w", prof.Name, err)
	}
	defer func() { _ = ch.Close() }()
	step := func(what string, err error) error {
		if err == nil {
			return ctx.Err()
		}
		var ae *amqp091.Error
		if errors.As(err, &ae) && ae.Code == amqp091.PreconditionFailed {
			return fmt.Errorf("provision profile %s: %s: %w: %s", prof.Name, what, ErrTopologyConflict, ae.Reason)
		}
		return fmt.Errorf("provision profile %s: %s: %w", prof.Name, what, err)
	}
	for i, x := range r.Exchanges {
		what := fmt.Sprintf("rabbitmq.exchanges[%d] %q", i, x.Name)
		if err := step(what, ch.ExchangeDeclare(x.Name, x.Type, x.IsDurable(), x.AutoDelete, x.Internal, false, amqp091.Table(x.Arguments))); err != nil {
			return err
		}
	}
	for i, q := range r.Queues {
		what := fmt.Sprintf("rabbitmq.queues[%d] %q", i, q.Name)
		if _, err := ch.QueueDeclare(q.Name, q.IsDurable(), q.AutoDelete, false, false, amqp091.Table(q.Arguments)); err != nil {
			return step(what, err)
		}
		for j, b := range q.Bindings {
			if err := step(fmt.Sprintf("%s.bindings[%d] from %q key %q", what, j, b.Exchange, b.Key),
				ch.QueueBind(q.Name, b.Key, b.Exchange, false, amqp091.Table(b.Arguments))); err != nil {
				return err
			}
		}
	}
	if err := p.applyPolicies(ctx); err != nil {
		return err
	}
	p.cfg.Logger.Info("amqp: profile provisioned", "profile", prof.Name, "exchanges", len(r.Exchanges), "queues", len(r.Queues))
	return nil
}

// applyPolicies sets each queue's policy, then waits until every such
// queue follows it: a user's policy of higher priority matching the queue
// would silently win, and the profile's dead-lettering with it.
func (p *ProfileProvisioner) applyPolicies(ctx context.Context) error {
	prof := p.cfg.Wire.Profile()
	r := prof.RabbitMQ
	uri, err := amqp091.ParseURI(p.cfg.URL)
	if err != nil {
		return err
	}
	vhost := uri.Vhost
	var ps []Policy
	var want []string
	for _, q := range r.Queues {
		if len(q.Policy) == 0 {
			continue
		}
		ps = append(ps, Policy{Name: wire.PolicyName(q.Name), Pattern: wire.PolicyPattern(q.Name), Definition: q.Policy, Priority: r.PolicyPriority})
		want = append(want, q.Name)
	}
	if len(ps) == 0 {
		return nil
	}
	if err := p.policies.SetPolicies(ctx, vhost, ps); err != nil {
		return fmt.Errorf("provision profile %s: rabbitmq.queues[].policy: %w", prof.Name, err)
	}
	wait := p.PolicyWait
	if wait <= 0 {
		wait = 30 * time.Second
	}
	deadline := time.Now().Add(wait)
	for {
		got, err := p.policies.QueuePolicies(ctx, vhost)
		if err != nil {
			return fmt.Errorf("provision profile %s: read the queues' policies: %w", prof.Name, err)
		}
		var wrong error
		for _, q := range want {
			if got[q] != wire.PolicyName(q) {
				wrong = fmt.Errorf("provision profile %s: queue %q follows policy %q, not %q: a policy of higher priority matches it (raise rabbitmq.policy_priority or narrow that policy)",
					prof.Name, q, got[q], wire.PolicyName(q))
				break
			}
		}
		if wrong == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return wrong
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (%v)", wrong, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// PoliciesFromEnv returns the PolicySetter FIFOBOX_AMQP_POLICIES chooses
// for the broker at amqpURL.
func PoliciesFromEnv(amqpURL string) (PolicySetter, error) {
	v := ProfileEnv.Get(EnvPolicies)
	switch {
	case v == "rabbitmqctl":
		return Rabbitmqctl{}, nil
	case v == "" || v == "management":
		return NewManagementPolicies("", amqpURL)
	case strings.HasPrefix(v, "management:"):
		return NewManagementPolicies(strings.TrimPrefix(v, "management:"), amqpURL)
	}
	return nil, fmt.Errorf("%s %q: management, management:<url> or rabbitmqctl", EnvPolicies, v)
}

// Rabbitmqctl sets policies with the rabbitmqctl command on this machine
// (a local broker without the management plugin). Path defaults to
// "rabbitmqctl" on PATH.
type Rabbitmqctl struct{ Path string }

func (r Rabbitmqctl) run(ctx context.Context, args ...string) (string, error) {
	return r.runInput(ctx, nil, args...)
}

func (r Rabbitmqctl) runInput(ctx context.Context, stdin []byte, args ...string) (string, error) {
	path := r.Path
	if path == "" {
		path = "rabbitmqctl"
	}
	cmd := exec.CommandContext(ctx, path, append([]string{"-q"}, args...)...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("rabbitmqctl %s: %w: %s", args[0], err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// SetPolicies implements PolicySetter: one import_definitions call (each
// rabbitmqctl call starts an Erlang VM, seconds on a busy machine).
func (r Rabbitmqctl) SetPolicies(ctx context.Context, vhost string, ps []Policy) error {
	type def struct {
		Vhost      string         `json:"vhost"`
		Name       string         `json:"name"`
		Pattern    string         `json:"pattern"`
		ApplyTo    string         `json:"apply-to"`
		Definition map[string]any `json:"definition"`
		Priority   int            `json:"priority"`
	}
	defs := struct {
		Policies []def `json:"policies"`
	}{}
	for _, p := range ps {
		defs.Policies = append(defs.Policies, def{vhost, p.Name, p.Pattern, "queues", p.Definition, p.Priority})
	}
	b, err := json.Marshal(defs)
	if err != nil {
		return err
	}
	// From standard input: given a file, the broker (another OS user)
	// reads it itself.
	_, err = r.runInput(ctx, b, "import_definitions")
	return err
}

// QueuePolicies implements PolicySetter.
func (r Rabbitmqctl) QueuePolicies(ctx context.Context, vhost string) (map[string]string, error) {
	out, err := r.run(ctx, "list_queues", "-p", vhost, "--no-table-headers", "name", "policy")
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		name, pol, _ := strings.Cut(strings.TrimRight(line, "\r"), "\t")
		if name != "" {
			m[name] = strings.TrimSpace(pol)
		}
	}
	return m, nil
}

// ManagementPolicies sets policies through the RabbitMQ management HTTP
// API (Amazon MQ serves it on https://<broker host>), as the AMQP URL's
// user, which needs the policymaker (or administrator) tag.
type ManagementPolicies struct {
	api *mgmtapi.Client
}

// NewManagementPolicies returns a PolicySetter for the API at base
// (default: https://<host> for an amqps URL, http://<host>:15672 for amqp).
func NewManagementPolicies(base, amqpURL string) (*ManagementPolicies, error) {
	a, err := amqp091.ParseURI(amqpURL)
	if err != nil {
		return nil, errors.New("management policies: the AMQP URL does not parse")
	}
	var u *url.URL
	switch {
	case base != "":
		if u, err = url.Parse(base); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("%s: management URL: want http(s)://host[:port]", EnvPolicies)
		}
	case a.Scheme == "amqps":
		u = &url.URL{Scheme: "https", Host: a.Host}
	default:
		u = &url.URL{Scheme: "http", Host: net.JoinHostPort(a.Host, "15672")}
	}
	return &ManagementPolicies{api: mgmtapi.New(*u, a.Username, a.Password, 30*time.Second)}, nil
}

// SetPolicies implements PolicySetter (PUT /api/policies/<vhost>/<name> each).
func (m *ManagementPolicies) SetPolicies(ctx context.Context, vhost string, ps []Policy) error {
	for _, p := range ps {
		if err := m.api.Do(ctx, http.MethodPut, "/api/policies/"+url.PathEscape(vhost)+"/"+url.PathEscape(p.Name), map[string]any{
			"pattern": p.Pattern, "definition": p.Definition, "priority": p.Priority, "apply-to": "queues",
		}, nil); err != nil {
			return fmt.Errorf("policy %s: %w", p.Name, err)
		}
	}
	return nil
}

// QueuePolicies implements PolicySetter (GET /api/queues/<vhost>).
func (m *ManagementPolicies) QueuePolicies(ctx context.Context, vhost string) (map[string]string, error) {
	var qs []struct {
		Name   string `json:"name"`
		Policy string `json:"policy"`
	}
	if err := m.api.Do(ctx, http.MethodGet, "/api/queues/"+url.PathEscape(vhost)+"?columns=name,policy", nil, &qs); err != nil {
		return nil, err
	}
	out := make(map[string]string, len(qs))
	for _, q := range qs {
		out[q.Name] = q.Policy
	}
	return out, nil
}

// wireFromEnv reads FIFOBOX_PROFILE: nil when unset.
func wireFromEnv() (*wire.Mapper, error) { return wire.MapperFromEnv(wire.TransportRabbitMQ) }

// newProvisioner is the transport's provisioner: the profile's when
// Config.Wire is set (with the policy setter FIFOBOX_AMQP_POLICIES
// chooses), else the topology's.
func newProvisioner(cfg Config) (transport.Provisioner, error) {
	if cfg.Wire == nil {
		return NewProvisioner(cfg)
	}
	pol, err := PoliciesFromEnv(cfg.URL)
	if err != nil {
		return nil, err
	}
	return NewProfileProvisioner(cfg, pol)
}

// selects reports whether some queue receives m: one of the topology's
// consumers, or with a wire profile one of the profile's queues (the
// unrouted-event policy asks it after a return).
func (p *Publisher) selects(m *outbox.Message) bool {
	if p.cfg.Wire == nil {
		return p.topo.selectedByAny(m)
	}
	w, err := p.cfg.Wire.Render(m)
	return err == nil && p.cfg.Wire.Profile().RabbitMQ.Selects(w.Destination)
}

// validateWire refuses what a wire profile cannot do: the alternate
// unrouted policy needs the topology's alternate exchange, which the
// profile's exchange does not name.
func (c *Config) validateWire() error {
	if c.Wire == nil {
		return nil
	}
	if c.Wire.Profile().RabbitMQ == nil {
		return fmt.Errorf("Wire: profile %s has no rabbitmq section", c.Wire.Profile().Name)
	}
	if c.Topology.Unrouted.Policy == transport.UnroutedAlternate {
		return fmt.Errorf("Wire (%s): profile %s: the alternate unrouted policy works with a topology's exchange only; use deliver (the default)", wire.EnvProfile, c.Wire.Profile().Name)
	}
	return nil
}
