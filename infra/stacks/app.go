package stacks

import (
	"fmt"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/jsii-runtime-go"
	"github.com/cdklabs/cdk-nag-go/cdknag/v2"
)

// Stacks are the stacks one app holds: either the AWS pair or the local variant.
type Stacks struct {
	Stateful  *StatefulStack
	Stateless *StatelessStack
	Local     *LocalStack
}

// Build adds fifobox's stacks to app. local selects the emulator variant
// (<Prefix>-Local); otherwise <Prefix>-Stateful and <Prefix>-Stateless are
// created and checked with cdk-nag's AwsSolutions pack (findings are errors
// and warnings on the stacks, which fail `cdk synth`/`deploy`).
func Build(app awscdk.App, cfg Config, local bool, env *awscdk.Environment) (*Stacks, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Stacks{}
	tags := func(desc string) *awscdk.StackProps {
		return &awscdk.StackProps{
			Env:         env,
			Description: jsii.String(desc),
			Tags:        &map[string]*string{"project": jsii.String("fifobox")},
		}
	}
	if local {
		if cfg.Transport != TransportSNS {
			return nil, fmt.Errorf("context transport=%s: the local (emulator) variant is SNS/SQS only; run the %s pipeline locally with `FIFOBOX_TRANSPORT=%s make local`", cfg.Transport, cfg.Transport, cfg.Transport)
		}
		s.Local = NewLocalStack(app, cfg.Prefix+"-Local", tags("fifobox pipeline for LocalStack/Floci (no VPC, no Aurora)"), cfg)
		return s, nil
	}
	s.Stateful = NewStatefulStack(app, cfg.Prefix+"-Stateful", tags(statefulDescription(cfg)), cfg)
	net := &Network{Vpc: s.Stateful.Vpc, Subnets: s.Stateful.Subnets, SecurityGroup: s.Stateful.FunctionSG, Proxy: s.Stateful.Proxy, Cluster: s.Stateful.Cluster, Broker: s.Stateful.Broker}
	s.Stateless = NewStatelessStack(app, cfg.Prefix+"-Stateless", tags(statelessDescription(cfg)), cfg, net)
	s.Stateless.AddStackDependency(s.Stateful.Stack, jsii.String("functions use the VPC and the database proxy"))
	for _, st := range []awscdk.Stack{s.Stateful.Stack, s.Stateless.Stack} {
		awscdk.Aspects_Of(st).Add(cdknag.NewAwsSolutionsChecks(&cdknag.NagPackProps{Verbose: jsii.Bool(true)}), nil)
	}
	return s, nil
}

func statefulDescription(cfg Config) string {
	if cfg.Transport == TransportRabbitMQ && !cfg.AMQP.Existing() {
		return "fifobox network, database and broker (VPC, Aurora Serverless v2, RDS Proxy, Amazon MQ for RabbitMQ)"
	}
	return "fifobox network and database (VPC, Aurora Serverless v2, RDS Proxy)"
}

func statelessDescription(cfg Config) string {
	switch cfg.Transport {
	case TransportRabbitMQ:
		return "fifobox pipeline on RabbitMQ (dispatcher, consumers on Amazon MQ, operations, alarms)"
	case TransportNATS:
		return "fifobox pipeline on NATS JetStream (dispatcher, operations, alarms)"
	}
	return "fifobox pipeline (SNS FIFO, SQS FIFO, dispatcher, consumers, redrive, alarms)"
}
