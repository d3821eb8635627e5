package stacks

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"
)

// Transports: where the dispatcher publishes (context transport). SNS/SQS
// FIFO is the default; the others keep fifobox's outbox, ordering, inbox and
// operations on a broker a team already runs.
const (
	TransportSNS = "sns"
	// TransportRabbitMQ is Amazon MQ for RabbitMQ: a broker fifobox creates
	// or an existing one, consumer Lambdas on its event source.
	TransportRabbitMQ = "rabbitmq"
	// TransportNATS is a NATS JetStream cluster outside AWS's services,
	// reached from the VPC: the dispatcher and the operations function only
	// (Lambda has no NATS event source; consumers run `fifobox consume`).
	TransportNATS = "nats"
)

// AMQPPort is Amazon MQ for RabbitMQ's AMQPS listener.
const AMQPPort = 5671

// maxTopologyJSON bounds a topology passed in a function's environment:
// Lambda allows 4 KB for all of a function's variables together.
const maxTopologyJSON = 2800

// AMQPConfig is the RabbitMQ transport (context keys amqp*).
type AMQPConfig struct {
	// TopologyFile is the RabbitMQ topology as JSON (the shape of
	// pkg/transport/amqp.Topology; topologies/rabbitmq/*.json are examples),
	// relative to infra/. Required. The functions get its content.
	TopologyFile string
	// VirtualHost the topology lives in. Default "/" (a new broker's only one).
	VirtualHost string

	// An existing broker: BrokerArn, Endpoint (amqps://host:5671) and
	// SecretArn (a JSON secret {"username", "password"}) together. Its
	// security group, if given, is opened to the functions on 5671;
	// otherwise the functions may reach 5671 anywhere in the VPC.
	BrokerArn, Endpoint, SecretArn, SecurityGroupID string

	// A new broker (when BrokerArn is empty).
	InstanceType   string // default mq.m5.large
	DeploymentMode string // CLUSTER_MULTI_AZ (default) or SINGLE_INSTANCE
	EngineVersion  string // default 3.13 (quorum queues)
	Username       string // the broker's user, its password generated into Secrets Manager; default fifobox
}

// Existing says whether an existing broker is used.
func (a AMQPConfig) Existing() bool { return a.BrokerArn != "" }

// NATSConfig is the NATS transport (context keys nats*).
type NATSConfig struct {
	// TopologyFile is the NATS topology as JSON (pkg/transport/nats.Topology;
	// topologies/nats/*.json), relative to infra/. Required.
	TopologyFile string
	// URL of the cluster (nats://host:4222 or tls://...; several comma
	// separated). Required: NATS is not an AWS service fifobox can create.
	URL string
	// SecretArn, if set, is a Secrets Manager secret holding the credentials:
	// {"username","password"}, {"token"} or {"creds"} (a .creds file's text).
	SecretArn string
	// SecretArns are per-function secrets (BrokerUserDispatcher,
	// BrokerUserOperations, BrokerUserProvisioner: context
	// natsDispatcherSecretArn, natsOperationsSecretArn,
	// natsProvisionerSecretArn), each that function's own NATS user (see
	// natsbus.Topology.AuthorizationConfig); a function without one uses
	// SecretArn.
	SecretArns map[string]string
	// CIDR and Port are where the functions may connect: default the VPC's
	// range and 4222.
	CIDR string
	Port float64
}

// AMQPConsumer is one consumer of the RabbitMQ topology, as far as the
// stacks need it: its Lambda, event source and alarms.
type AMQPConsumer struct {
	Name  string `json:"name"`
	Queue string `json:"queue"`
}

// QueueName is the consumer's queue (default its name).
func (c AMQPConsumer) QueueName() string {
	if c.Queue != "" {
		return c.Queue
	}
	return c.Name
}

// DLQName is the consumer's dead-letter queue.
func (c AMQPConsumer) DLQName() string { return c.QueueName() + ".dlq" }

// LoadedTopology is a broker topology file: its compact JSON (what the
// functions get as FIFOBOX_AMQP_TOPOLOGY / FIFOBOX_NATS_TOPOLOGY, where
// pkg/transport validates it fully; functions/runtimetest loads the
// synthesised value with the real loaders) and, for RabbitMQ, its consumers.
type LoadedTopology struct {
	JSON      string
	Consumers []AMQPConsumer
}

var (
	consumerName = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)
	// validUsername: Amazon MQ user names, as this stack passes them on.
	validUsername = regexp.MustCompile(`^[A-Za-z0-9_.~-]{1,100}$`)
)

// LoadTopologyFile reads a broker topology file for context key key.
func LoadTopologyFile(key, path string) (LoadedTopology, error) {
	if path == "" {
		return LoadedTopology{}, fmt.Errorf("context %s: required (a topology JSON file, e.g. ../topologies/rabbitmq/ticketing.json)", key)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return LoadedTopology{}, fmt.Errorf("context %s: %w", key, err)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, b); err != nil {
		return LoadedTopology{}, fmt.Errorf("context %s: %s is not JSON: %w", key, path, err)
	}
	if compact.Len() > maxTopologyJSON {
		return LoadedTopology{}, fmt.Errorf("context %s: %s is %d bytes compacted; a function's environment holds 4 KB in all, so keep it under %d", key, path, compact.Len(), maxTopologyJSON)
	}
	var parsed struct {
		Consumers []AMQPConsumer `json:"consumers"`
	}
	if err := json.Unmarshal(compact.Bytes(), &parsed); err != nil {
		return LoadedTopology{}, fmt.Errorf("context %s: %s: %w", key, path, err)
	}
	seen := map[string]bool{}
	for i, c := range parsed.Consumers {
		if !consumerName.MatchString(c.Name) {
			return LoadedTopology{}, fmt.Errorf("context %s: %s: consumers[%d].name %q: 1-64 letters, digits, '.', '_' or '-'", key, path, i, c.Name)
		}
		if seen[c.Name] {
			return LoadedTopology{}, fmt.Errorf("context %s: %s: consumers[%d].name %q repeats", key, path, i, c.Name)
		}
		seen[c.Name] = true
	}
	return LoadedTopology{JSON: compact.String(), Consumers: parsed.Consumers}, nil
}

// validateTransport checks the transport settings (Config.Validate).
func (c Config) validateTransport() error {
	switch c.Transport {
	case TransportSNS:
		return nil
	case TransportRabbitMQ:
		a := c.AMQP
		top, err := LoadTopologyFile("amqpTopology", a.TopologyFile)
		if err != nil {
			return err
		}
		if len(top.Consumers) == 0 {
			return fmt.Errorf("context amqpTopology: %s has no consumers", a.TopologyFile)
		}
		if a.VirtualHost == "" {
			return fmt.Errorf("context amqpVirtualHost: must not be empty (\"/\" is the default virtual host)")
		}
		existing := []string{a.BrokerArn, a.Endpoint, a.SecretArn}
		set := 0
		for _, v := range existing {
			if v != "" {
				set++
			}
		}
		if set != 0 && set != 3 {
			return fmt.Errorf("an existing broker needs all of amqpBrokerArn, amqpEndpoint, amqpSecretArn")
		}
		if a.Existing() {
			if !strings.HasPrefix(a.BrokerArn, "arn:") || !strings.Contains(a.BrokerArn, ":broker:") {
				return fmt.Errorf("context amqpBrokerArn %q: want an Amazon MQ broker ARN (arn:aws:mq:<region>:<account>:broker:<name>:<id>)", a.BrokerArn)
			}
			u, err := url.Parse(a.Endpoint)
			if err != nil || u.Scheme != "amqps" || u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") {
				return fmt.Errorf("context amqpEndpoint %q: want amqps://<host>:5671 (no credentials: they come from amqpSecretArn; no virtual host: see amqpVirtualHost)", a.Endpoint)
			}
			return nil
		}
		switch a.DeploymentMode {
		case "CLUSTER_MULTI_AZ", "SINGLE_INSTANCE":
		default:
			return fmt.Errorf("context amqpDeploymentMode %q: CLUSTER_MULTI_AZ or SINGLE_INSTANCE", a.DeploymentMode)
		}
		if !validUsername.MatchString(a.Username) {
			return fmt.Errorf("context amqpUsername %q: letters, digits and -_.~ only", a.Username)
		}
		// The functions' users are named after it (BrokerUsername).
		for _, cons := range top.Consumers {
			if n := BrokerUsername(c, BrokerUserConsumer(cons.Name)); len(n) > 100 {
				return fmt.Errorf("context amqpUsername %q: consumer %s's broker user %s is %d characters, Amazon MQ allows 100", a.Username, cons.Name, n, len(n))
			}
		}
		if len(c.Prefix)+len("-broker") > 50 {
			return fmt.Errorf("prefix %q: the broker's name <prefix>-broker must be at most 50 characters", c.Prefix)
		}
		return nil
	case TransportNATS:
		n := c.NATS
		if _, err := LoadTopologyFile("natsTopology", n.TopologyFile); err != nil {
			return err
		}
		if n.URL == "" {
			return fmt.Errorf("context natsUrl: required with transport=nats (nats://host:4222, tls://host:4222; several comma separated)")
		}
		for _, s := range strings.Split(n.URL, ",") {
			u, err := url.Parse(strings.TrimSpace(s))
			if err != nil || (u.Scheme != "nats" && u.Scheme != "tls") || u.Host == "" || u.User != nil {
				return fmt.Errorf("context natsUrl %q: want nats://host:port or tls://host:port, without credentials (they come from natsSecretArn)", s)
			}
		}
		if n.Port < 1 || n.Port > 65535 {
			return fmt.Errorf("context natsPort %v: want 1-65535", n.Port)
		}
		return nil
	}
	return fmt.Errorf("context transport %q: sns, rabbitmq or nats", c.Transport)
}
